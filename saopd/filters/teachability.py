"""Token Teachability (TA-OPD, arXiv 2605.26844): keep the most teachable tokens of the batch.

As in ``BASELINES.md`` [repro]; per valid token t, with K = ``top_k`` (16):

- disagreement D_t: the forward KL(pi_T || pi_S) on the top-K supports, i.e. over the union
  U_t of the teacher's and the student's top-K ids with the rest of the vocabulary lumped into
  one tail bucket (``saopd.signals.topk.bucket_kl``):
  D_t = sum_{v in U_t} q_v log(q_v / p_v) + Q_tail log(Q_tail / P_tail);
- compatibility C_t: the teacher's mass on the student's top-K ids, C_t = sum_{v in S_t} q_v
  (S_t the student's top-K), the share of the teacher's correction the student can absorb;
- quantile normalisation over the valid tokens of the batch: x_norm = clip((x - Q_lo(x)) /
  (Q_hi(x) - Q_lo(x)), 0, 1) with Q the ``torch.quantile`` (linear interpolation, float64) at
  ``quantile_low`` = 0.05 and ``quantile_high`` = 0.95; when Q_hi - Q_lo is float32 rounding
  noise of their magnitude (``saopd.filters.spread``: at most 16 eps * max(|Q_lo|, |Q_hi|), an
  exact zero included), x counts as constant: x_norm = 1[x > Q_lo beyond that noise];
- score s_t = D_norm * C_norm; keep the floor(``keep_ratio`` * N) tokens of the batch with the
  largest score (keep_ratio = 0.05, the paper's headline budget; ties by position, row-major, as
  every rank set in saopd), then
  in every non-empty response that has no kept token, also keep its best-scoring token (the
  earliest on ties): at least one token per response.

[ours] where the sources are silent: "top-16 supports" is read as the union of both models'
top-16 sets with the tail lumped (the same coarse-grained KL as the top-k KL objectives);
the selection count uses floor like the rank sets of SA-OPD; the guarantee of one token per
response is added after the global top-``keep_ratio``, so the kept share can exceed
``keep_ratio`` by at most one token per response. Signals with a larger K than ``top_k`` are cut
to their first ``top_k`` columns (top-k lists are sorted, so this is the top-``top_k`` list).

Loss: the filter only selects; the method pairs it with the sampled OPD objective
(``conf/method/teachability.yaml``), token-mean over the kept tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from saopd.filters.base import (
    FILTERS,
    FilterResult,
    TokenFilter,
    result_from_filtered,
    scatter_valid,
)
from saopd.filters.ranks import count_for, largest_k_mask
from saopd.filters.spread import quantile_normalize
from saopd.filters.tip import per_row_top_k
from saopd.signals.token_signals import (
    STUDENT_TOPK_FIELDS,
    TEACHER_TOPK_FIELDS,
    TokenSignals,
)
from saopd.signals.topk import bucket_kl, union_mask
from saopd.validation import check_fraction, check_int


def _cut(signals: TokenSignals, names: tuple[str, ...], k: int) -> list[torch.Tensor]:
    """The fields ``names`` of one top-k group, first ``k`` columns, compact ``[N, k]``."""
    out = []
    for name in names:
        value = getattr(signals, name)
        out.append(value.detach()[..., :k][signals.valid])
    return out


def teachability_scores(signals: TokenSignals, *, top_k: int = 16, quantile_low: float = 0.05,
                        quantile_high: float = 0.95) -> dict[str, torch.Tensor]:
    """D, C and the score s = D_norm * C_norm of every valid token, compact float32 ``[N]``
    (row-major order of ``signals.valid``). Needs both top-k groups with K >= ``top_k``.

    Returns a dict with ``disagreement`` (D, nats), ``compatibility`` (C, a probability mass)
    and ``score`` (in [0, 1])."""
    t_ids, t_lp_t, t_lp_s = _cut(signals, TEACHER_TOPK_FIELDS, top_k)
    s_ids, s_lp_s, s_lp_t = _cut(signals, STUDENT_TOPK_FIELDS, top_k)
    # forward KL(pi_T || pi_S) over the union of both top-K sets, tail lumped
    mask = union_mask(t_ids, s_ids)  # [N, 2K]
    d = bucket_kl(torch.cat([t_lp_t, s_lp_t], -1), torch.cat([t_lp_s, s_lp_s], -1), mask)
    c = s_lp_t.double().exp().sum(dim=-1).float()  # teacher mass on the student's top-K
    score = (quantile_normalize(d, quantile_low, quantile_high)
             * quantile_normalize(c, quantile_low, quantile_high))
    return {"disagreement": d, "compatibility": c, "score": score}


@FILTERS.register("teachability")
@dataclass
class TeachabilityFilter(TokenFilter):
    """TA-OPD: keep the global top ``keep_ratio`` of valid tokens by teachability, and at least
    one token of every non-empty response (see the module docstring for the formulas).

    Attributes:
        keep_ratio: kept share of the batch's valid tokens before the one-per-response rule
            (0.05, the paper's headline 5% budget).
        top_k: K of both top-K supports (16); the signals must hold at least K ids per position.
        quantile_low, quantile_high: the normalisation quantiles (0.05, 0.95).
    """

    label = "TA-OPD"
    table_order = 40

    keep_ratio: float = 0.05
    top_k: int = 16
    quantile_low: float = 0.05
    quantile_high: float = 0.95
    requires = TEACHER_TOPK_FIELDS + STUDENT_TOPK_FIELDS

    def __post_init__(self) -> None:
        owner = "TeachabilityFilter"
        check_fraction("keep_ratio", self.keep_ratio, owner=owner)
        check_int("top_k", self.top_k, owner=owner)
        check_fraction("quantile_low", self.quantile_low, owner=owner)
        check_fraction("quantile_high", self.quantile_high, owner=owner)
        if not self.quantile_low < self.quantile_high:
            raise ValueError(f"{owner}: quantile_low must be < quantile_high, got "
                             f"{self.quantile_low} and {self.quantile_high}")

    def apply(self, signals: TokenSignals, *,
              generator: torch.Generator | None = None) -> FilterResult:
        for group in ("teacher", "student"):
            if signals.top_k(group) < self.top_k:
                raise ValueError(
                    f"filter 'teachability' needs the {group}'s top-{self.top_k} ids, the "
                    f"signals hold top-{signals.top_k(group)}: score with top_k >= {self.top_k}")
        valid = signals.valid
        parts = teachability_scores(signals, top_k=self.top_k, quantile_low=self.quantile_low,
                                    quantile_high=self.quantile_high)
        score = parts["score"]  # [N]
        n = score.numel()
        kept = scatter_valid(largest_k_mask(score, count_for(self.keep_ratio, n)), valid)
        # at least one token per non-empty response: its best score, earliest on ties
        dense = torch.where(valid, scatter_valid(score, valid),
                            torch.full((), float("-inf"), device=valid.device))
        best = per_row_top_k(dense, torch.ones(valid.shape[0], dtype=torch.long,
                                               device=valid.device))
        lacking = valid.any(dim=1) & ~kept.any(dim=1)  # [B]
        kept = kept | (best & valid & lacking[:, None])
        result = result_from_filtered(signals, valid & ~kept)
        result.stats["responses_topped_up"] = float(lacking.sum())
        for name, values in parts.items():
            compact_kept = kept[valid]
            result.stats[f"{name}_kept"] = (float(values[compact_kept].double().mean())
                                            if bool(compact_kept.any()) else 0.0)
            result.stats[f"{name}_mean"] = float(values.double().mean()) if n else 0.0
        return result
