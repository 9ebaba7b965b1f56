"""KL objectives on the teacher's top-K ids, tail lumped; and Entropy-Aware OPD.

The top-k distillation losses of large OPD systems (verl's top-k forward KL with k = 32, NeMo-RL's
with k = 64) see the teacher only at its K most probable ids per position: what a
teacher-scoring service returns with an explicit ``top_k`` option, or what
``saopd.signals.score_tokens(..., teacher_top_k=K)`` computes. With q the teacher's and p the
student's probabilities at those ids, and the rest of the vocabulary lumped into one tail bucket
(``saopd.signals.topk``; P_tail = 1 - sum_k p_k, Q_tail likewise):

- forward:  KL_K(pi_T || pi_S) = sum_k q_k log(q_k / p_k) + Q_tail log(Q_tail / P_tail)
- reverse:  KL_K(pi_S || pi_T) = sum_k p_k log(p_k / q_k) + P_tail log(P_tail / Q_tail)

Both are exact KLs between (K + 1)-bucket distributions: >= 0, at most the full-vocabulary KL
of the same direction, equal to it at K = V. Gradient flows through the student's log-probs at
the K ids (``teacher_topk_lp_student``; the chunked scoring's recomputing backward), including
through P_tail = 1 - sum_k p_k; the teacher is a constant. [ours] The tail is lumped rather than
the K probabilities renormalised, so mass the student puts outside the teacher's top-K is still
penalised (renormalising would ignore it).

Entropy-Aware OPD (arXiv 2603.07079, ``BASELINES.md`` [repro]) keeps vanilla OPD's sampled
estimator and adds the forward top-K KL at the positions where the teacher is uncertain:
loss_t = A_t.detach() * lpS + coef * 1[H_T > threshold] * KL_K(pi_T || pi_S), with K = 16,
threshold = 0.8 nats and [ours] coef = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from saopd.filters.base import FilterResult
from saopd.objectives.base import OBJECTIVES, Objective, ObjectiveOutput, masked_mean
from saopd.objectives.sampled import sampled_opd_loss
from saopd.signals.token_signals import TEACHER_TOPK_FIELDS, TokenSignals
from saopd.signals.topk import bucket_kl
from saopd.validation import check_choice, check_int, check_positive

KL_DIRECTIONS = ("forward", "reverse")
"""``forward`` = KL(pi_T || pi_S), ``reverse`` = KL(pi_S || pi_T)."""


def teacher_topk_kl(signals: TokenSignals, top_k: int, direction: str = "forward"
                    ) -> torch.Tensor:
    """KL_K of ``direction`` on the teacher's first ``top_k`` ids, float32 ``[B, T]``
    (0-input at invalid positions gives a finite, ignored value). Differentiable through
    ``teacher_topk_lp_student``.

    Raises:
        ValueError: the signals lack the teacher's top-k group or hold fewer than ``top_k`` ids.
    """
    k = signals.top_k("teacher")
    if k < top_k:
        raise ValueError(f"the teacher's top-{top_k} is needed, the signals hold top-{k}: score "
                         f"with teacher top_k >= {top_k}")
    assert signals.teacher_topk_lp_teacher is not None
    assert signals.teacher_topk_lp_student is not None
    lp_t = signals.teacher_topk_lp_teacher[..., :top_k]
    lp_s = signals.teacher_topk_lp_student[..., :top_k]
    return bucket_kl(lp_t, lp_s) if direction == "forward" else bucket_kl(lp_s, lp_t)


@OBJECTIVES.register("topk_kl")
@dataclass
class TopKKL(Objective):
    """KL on the teacher's top-K ids with the tail lumped (module docstring), per kept token.

    Attributes:
        direction: ``forward`` = KL(pi_T || pi_S) (verl, NeMo-RL) or ``reverse`` =
            KL(pi_S || pi_T) (the direction of OPD's Eq. 1, restricted to the teacher's top-K).
        top_k: K (32, verl's; NeMo-RL uses 64). The signals must hold at least K ids.
    """

    direction: str = "forward"
    top_k: int = 32
    requires = TEACHER_TOPK_FIELDS

    def __post_init__(self) -> None:
        check_choice("direction", self.direction, KL_DIRECTIONS, owner="TopKKL")
        check_int("top_k", self.top_k, owner="TopKKL")

    def token_loss(self, signals: TokenSignals, result: FilterResult) -> ObjectiveOutput:
        kl = teacher_topk_kl(signals, self.top_k, self.direction)
        return ObjectiveOutput(loss=kl, metrics={f"kl_topk_{self.direction}":
                                                 masked_mean(kl, signals.valid)})


@OBJECTIVES.register("entropy_aware")
@dataclass
class EntropyAwareOPD(Objective):
    """Entropy-Aware OPD: sampled OPD plus ``coef`` x the forward KL on the teacher's top-K
    where the teacher's entropy H_T exceeds ``entropy_threshold`` (strictly).

    Attributes:
        entropy_threshold: H_T in nats above which the forward KL is added (0.8).
        top_k: K of the teacher's top-K support (16).
        coef: weight of the forward KL term (1.0).
        importance_ratio_cap: as in :class:`saopd.objectives.sampled.SampledOPD` (applies to
            the sampled term only).
    """

    entropy_threshold: float = 0.8
    top_k: int = 16
    coef: float = 1.0
    importance_ratio_cap: float | None = None
    requires = ("entropy_teacher", *TEACHER_TOPK_FIELDS)

    def __post_init__(self) -> None:
        owner = "EntropyAwareOPD"
        check_positive("entropy_threshold", self.entropy_threshold, owner=owner,
                       allow_zero=True)
        check_int("top_k", self.top_k, owner=owner)
        check_positive("coef", self.coef, owner=owner, allow_zero=True)
        if self.importance_ratio_cap is not None:
            check_positive("importance_ratio_cap", self.importance_ratio_cap, owner=owner)

    @property
    def needs(self) -> tuple[str, ...]:
        return self.requires + (("lp_sampler",) if self.importance_ratio_cap is not None else ())

    def token_loss(self, signals: TokenSignals, result: FilterResult) -> ObjectiveOutput:
        assert signals.entropy_teacher is not None
        out = sampled_opd_loss(signals.a_full, signals.lp_student, lp_sampler=signals.lp_sampler,
                               ratio_cap=self.importance_ratio_cap, valid=signals.valid)
        fkl = teacher_topk_kl(signals, self.top_k, "forward")
        gate = signals.entropy_teacher > self.entropy_threshold  # [B, T]
        zero = torch.zeros((), dtype=fkl.dtype, device=fkl.device)
        out.loss = out.loss + self.coef * torch.where(gate, fkl, zero)
        out.metrics["kl_topk_forward"] = masked_mean(fkl, signals.valid)
        out.metrics["entropy_gated_share"] = masked_mean(gate.float(), signals.valid)
        return out
