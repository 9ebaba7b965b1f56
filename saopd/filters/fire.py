"""FiRe-OPD (arXiv 2606.02684): a trajectory filter plus entropy-based token weights.

As in ``BASELINES.md``:
- trajectory filter: drop the responses whose mean teacher log-prob mean_t lpT lies strictly
  below ``torch.quantile(means, drop_fraction)`` (linear interpolation, float32) over the
  non-empty responses of the batch, the released code's rule: responses tied with the threshold
  are kept, and 8 distinct means drop 2 (the 0.2-quantile lies between the 2nd and 3rd smallest),
  where a rank rule floor(0.2 * 8) would drop 1. Computed over the whole batch (the released code
  does it per micro-batch of one, which disables it);
- token weights (no gradient): tc = clip(1 - H_T / max H_T, 0, 1), sc = clip(H_S / max H_S, 0, 1),
  w = (1 + a*tc)(1 + b*sc), rescaled to mean 1 over the valid tokens of the batch;
- the loss is then the OPD loss times w on the tokens of kept responses (token-mean).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from saopd.filters.base import FILTERS, FilterResult, TokenFilter, result_from_filtered
from saopd.signals.token_signals import TokenSignals
from saopd.validation import check_fraction, check_positive


def fire_token_weights(entropy_student: torch.Tensor, entropy_teacher: torch.Tensor,
                       valid: torch.Tensor, *, a: float = 1.0, b: float = 1.0) -> torch.Tensor:
    """w = (1 + a*tc)(1 + b*sc), mean 1 over valid tokens. Float [B, T]; 0 at invalid positions.

    A batch whose max entropy is 0 gives tc = 1 (teacher certain everywhere) and sc = 0.
    """
    tiny = torch.finfo(torch.float32).tiny
    h_t = entropy_teacher.detach().float()
    h_s = entropy_student.detach().float()
    zero = torch.zeros((), device=valid.device)
    max_t = torch.where(valid, h_t, zero).max().clamp_min(tiny)  # max over valid tokens
    max_s = torch.where(valid, h_s, zero).max().clamp_min(tiny)
    tc = (1.0 - h_t / max_t).clamp(0.0, 1.0)
    sc = (h_s / max_s).clamp(0.0, 1.0)
    w = torch.where(valid, (1.0 + a * tc) * (1.0 + b * sc), zero)  # [B, T]
    n = int(valid.sum())
    # the mean over the compact valid tokens: padding cannot change the summation order
    return w / (w[valid].sum() / n).clamp_min(tiny) if n else w


@FILTERS.register("fire")
@dataclass
class FiReFilter(TokenFilter):
    """FiRe-OPD: drop low-teacher-likelihood responses, re-weight the tokens of the rest.

    Attributes:
        drop_fraction: the quantile of the non-empty responses' mean teacher log-probs below
            which a response is dropped (0.2; strictly below, ties kept, as released).
        a: weight of teacher confidence tc (1.0).
        b: weight of student uncertainty sc (1.0).
    """

    label = "FiRe-OPD"
    table_order = 20

    drop_fraction: float = 0.2
    a: float = 1.0
    b: float = 1.0
    requires = ("entropy_student", "entropy_teacher")

    def __post_init__(self) -> None:
        check_fraction("drop_fraction", self.drop_fraction, owner="FiReFilter")
        check_positive("a", self.a, owner="FiReFilter", allow_zero=True)
        check_positive("b", self.b, owner="FiReFilter", allow_zero=True)

    def apply(self, signals: TokenSignals, *,
              generator: torch.Generator | None = None) -> FilterResult:
        assert signals.entropy_student is not None and signals.entropy_teacher is not None
        valid = signals.valid
        lengths = valid.sum(dim=1)  # [B]
        nonempty = lengths > 0
        mean_lp_t = signals.lp_teacher.sum(dim=1) / lengths.clamp_min(1)  # [B]
        dropped = torch.zeros_like(nonempty)
        if bool(nonempty.any()):
            means = mean_lp_t[nonempty]  # float32 [N], as the released code's
            dropped[nonempty] = means < torch.quantile(means, self.drop_fraction)
        filtered = valid & dropped[:, None]
        result = result_from_filtered(signals, filtered)
        weights = fire_token_weights(signals.entropy_student, signals.entropy_teacher, valid,
                                     a=self.a, b=self.b)
        result.weights = weights * result.keep
        result.stats["dropped_responses"] = float(dropped.sum())
        result.stats["weight_mean_kept"] = (
            float(weights[result.keep].mean()) if bool(result.keep.any()) else 0.0
        )
        return result
