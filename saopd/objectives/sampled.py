"""Sampled OPD estimators: vanilla OPD (paper Eq. 2-3) and ExOPD reward extrapolation.

For a sampled token y_t the per-token loss is ``c_t * lpS`` with a stop-gradient coefficient c_t,
so its gradient is ``c_t * grad lpS`` and a descent step moves along ``-c_t grad lpS``: with
c_t = A_t = lpS - lpT this is the update of Eq. 3. When rollouts come from a different sampler
(vLLM) the coefficient is multiplied by the truncated importance ratio
``min(exp(lpS - lp_sampler), cap)`` (verl / G-OPD), correcting the trainer/sampler mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from saopd.filters.base import FilterResult
from saopd.objectives.base import OBJECTIVES, Objective, ObjectiveOutput, masked_mean
from saopd.signals.token_signals import TokenSignals
from saopd.validation import check_positive


def sampled_opd_loss(
    coefficient: torch.Tensor,
    lp_student: torch.Tensor,
    *,
    lp_sampler: torch.Tensor | None = None,
    ratio_cap: float | None = None,
    valid: torch.Tensor | None = None,
) -> ObjectiveOutput:
    """Per-token loss ``c.detach() * [ratio] * lpS``; all tensors [B, T].

    Args:
        coefficient: c_t, treated as a constant (A_t for OPD, the extrapolated A for ExOPD).
        lp_student: log pi_S(y_t | x, y_<t) with gradient.
        lp_sampler: the rollout engine's log-prob of y_t; with ``ratio_cap`` enables the
            truncated importance ratio min(exp(lpS - lp_sampler), ratio_cap) (no gradient).
        ratio_cap: truncation of the importance ratio (5.0 in verl and G-OPD); None = off.
        valid: bool [B, T] used only for the ratio metrics.
    """
    coef = coefficient.detach()
    metrics: dict[str, torch.Tensor] = {}
    if ratio_cap is not None and lp_sampler is not None:
        raw = torch.exp((lp_student.detach() - lp_sampler).clamp(max=50.0))
        ratio = raw.clamp(max=ratio_cap)
        coef = coef * ratio
        if valid is not None:
            metrics["importance_ratio"] = masked_mean(raw, valid)
            metrics["importance_ratio_clipped"] = masked_mean((raw > ratio_cap).float(), valid)
    return ObjectiveOutput(loss=coef * lp_student, metrics=metrics)


@OBJECTIVES.register("sampled")
@dataclass
class SampledOPD(Objective):
    """Vanilla OPD's sampled reverse-KL estimator: loss_t = A_t.detach() * lpS (Eq. 2-3).

    Attributes:
        importance_ratio_cap: truncate exp(lpS - lp_sampler) at this value and multiply the
            coefficient by it (needs ``lp_sampler``); None (default with HF rollouts, where
            sampler == trainer) turns it off; 5.0 is the recommended value with vLLM.
    """

    importance_ratio_cap: float | None = None

    def __post_init__(self) -> None:
        if self.importance_ratio_cap is not None:
            check_positive("importance_ratio_cap", self.importance_ratio_cap, owner="SampledOPD")

    @property
    def needs(self) -> tuple[str, ...]:
        return ("lp_sampler",) if self.importance_ratio_cap is not None else ()

    def token_loss(self, signals: TokenSignals, result: FilterResult) -> ObjectiveOutput:
        return sampled_opd_loss(signals.a_full, signals.lp_student, lp_sampler=signals.lp_sampler,
                                ratio_cap=self.importance_ratio_cap, valid=signals.valid)


@OBJECTIVES.register("exopd")
@dataclass
class ExOPD(Objective):
    """ExOPD / G-OPD reward extrapolation (arXiv 2602.12125).

    c_t = (lpS - lpRef) - lam * (lpT - lpRef), with pi_Ref the frozen initial student; lam = 1
    recovers vanilla OPD exactly, lam > 1 extrapolates past the teacher.

    Attributes:
        lam: extrapolation factor lambda (1.25 in the paper).
        importance_ratio_cap: as in :class:`SampledOPD`.
    """

    label = "ExOPD"
    table_order = 10
    standalone = True

    lam: float = 1.25
    importance_ratio_cap: float | None = None
    requires = ("lp_ref",)

    def __post_init__(self) -> None:
        check_positive("lam", self.lam, owner="ExOPD", allow_zero=True)
        if self.importance_ratio_cap is not None:
            check_positive("importance_ratio_cap", self.importance_ratio_cap, owner="ExOPD")

    @property
    def needs(self) -> tuple[str, ...]:
        return self.requires + (("lp_sampler",) if self.importance_ratio_cap is not None else ())

    def token_loss(self, signals: TokenSignals, result: FilterResult) -> ObjectiveOutput:
        assert signals.lp_ref is not None
        lp_s = signals.lp_student.detach()
        coef = (lp_s - signals.lp_ref) - self.lam * (signals.lp_teacher - signals.lp_ref)
        out = sampled_opd_loss(coef, signals.lp_student, lp_sampler=signals.lp_sampler,
                               ratio_cap=self.importance_ratio_cap, valid=signals.valid)
        out.metrics["exopd_coefficient"] = masked_mean(coef, result.keep)
        return out
