"""KL objectives on the teacher's top-K ids; and Entropy-Aware OPD.

The top-k distillation losses of large OPD systems see the teacher only at its K most probable
ids per position: what a teacher-scoring service returns with an explicit ``top_k`` option, or
what ``saopd.signals.score_tokens(..., teacher_top_k=K)`` computes. With q the teacher's and p
the student's probabilities at those ids, ``tail`` chooses what is done with the rest of the
vocabulary (``saopd.signals.topk``; P_tail = 1 - sum_k p_k, Q_tail likewise):

- ``lumped`` [ours, the default]: the rest is one tail bucket, an exact KL between
  (K + 1)-bucket distributions, >= 0, at most the full-vocabulary KL of the same direction,
  equal to it at K = V; mass the student puts outside the teacher's top-K is penalised:

    forward:  KL_K(pi_T || pi_S) = sum_k q_k log(q_k / p_k) + Q_tail log(Q_tail / P_tail)
    reverse:  KL_K(pi_S || pi_T) = sum_k p_k log(p_k / q_k) + P_tail log(P_tail / Q_tail)

- ``none``: the sum over the K ids alone, no tail term, no renormalisation. Forward,
  ``sum_k q_k log(q_k / p_k)``, is verl's ``compute_forward_kl_topk`` (k = 32; without its
  optional ``log_prob_min_clamp``); reverse, ``sum_k p_k log(p_k / q_k)`` over the teacher's
  ids, has no released counterpart. Not a divergence: it can be negative, and the student can
  lower it by moving mass off the listed ids.
- ``renormalize``: the KL between q and p each renormalised over the K ids (a softmax of the
  K log-probs), NeMo-RL's ``DistillationLossFn`` with its default ``zero_outside_topk: false``
  (``kl_type: forward`` or ``reverse``; its ``mixed`` is not offered; k = 64 in its example
  config). Ignores the student's mass outside the K ids.

The lumped tails are exact where the logits were at hand: the chunked scoring computes each
side's log-mass outside the K ids by a logsumexp over the unlisted logits
(``TokenSignals.teacher_topk_tail_teacher`` / ``teacher_topk_tail_student``); with ``top_k``
below the signals' K, the columns between are added back (``saopd.signals.topk.prefix_tail``).
A side without them (the teacher's, when a teacher-scoring service gave only lists) takes the
tail from its list, floored at a mass of 1e-6, the smallest a float32 list resolves; the metrics
``topk_tail_exact_teacher`` (1 = exact, 0 = from the list) and ``topk_tail_floored`` (share of
valid positions where a list-only tail hit the floor) record which happened, in MLflow and in
``summary.json``'s metrics.

Gradient flows through the student's log-probs at the K ids (``teacher_topk_lp_student``; the
chunked scoring's recomputing backward) and, for ``lumped``, through its exact tail (or
through P_tail = 1 - sum_k p_k from the list); the teacher is a constant.

Entropy-Aware OPD (arXiv 2603.07079, ``BASELINES.md`` [repro]) keeps vanilla OPD's sampled
estimator and adds the forward top-K KL (tail lumped, as above) at the positions where the
teacher is uncertain: loss_t = A_t.detach() * lpS + coef * 1[H_T > threshold] * KL_K(pi_T ||
pi_S), with K = 16, threshold = 0.8 nats and [ours] coef = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from saopd.filters.base import FilterResult
from saopd.objectives.base import OBJECTIVES, Objective, ObjectiveOutput, masked_mean
from saopd.objectives.sampled import sampled_opd_loss
from saopd.signals.token_signals import TEACHER_TOPK_FIELDS, TokenSignals
from saopd.signals.topk import (
    bucket_kl,
    prefix_tail,
    renormalized_kl,
    tail_floored,
    truncated_kl,
)
from saopd.validation import check_choice, check_int, check_positive

KL_DIRECTIONS = ("forward", "reverse")
"""``forward`` = KL(pi_T || pi_S), ``reverse`` = KL(pi_S || pi_T)."""
TOPK_TAILS = ("lumped", "none", "renormalize")
"""What a top-k KL does with the vocabulary outside the K ids (module docstring): ``lumped``
(one tail bucket, ours), ``none`` (ignored, verl), ``renormalize`` (both lists renormalised,
NeMo-RL's default)."""


@dataclass
class TopKDivergence:
    """A top-k KL per position and how its tails were obtained.

    Attributes:
        kl: float32 ``[B, T]`` (finite, ignored values at invalid positions).
        tail_exact_teacher: whether the teacher's tail came from the whole vocabulary (None for
            the tail modes that use no tail).
        tail_floored: bool ``[B, T]``, where a list-only tail hit its floor (None without a
            tail).
    """

    kl: torch.Tensor
    tail_exact_teacher: bool | None = None
    tail_floored: torch.Tensor | None = None

    def metrics(self, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        """``topk_tail_exact_teacher`` and ``topk_tail_floored`` (empty without a tail)."""
        if self.tail_floored is None:
            return {}
        return {"topk_tail_exact_teacher": torch.tensor(float(bool(self.tail_exact_teacher)),
                                                        device=valid.device),
                "topk_tail_floored": masked_mean(self.tail_floored.float(), valid)}


def teacher_topk_divergence(signals: TokenSignals, top_k: int, direction: str = "forward",
                            tail: str = "lumped") -> TopKDivergence:
    """The top-k KL of ``direction`` on the teacher's first ``top_k`` ids with ``tail``'s
    treatment of the rest (module docstring), float32 ``[B, T]``, differentiable through
    ``teacher_topk_lp_student`` (and ``teacher_topk_tail_student``).

    Raises:
        ValueError: the signals lack the teacher's top-k group or hold fewer than ``top_k`` ids.
    """
    k = signals.top_k("teacher")
    if k < top_k:
        raise ValueError(f"the teacher's top-{top_k} is needed, the signals hold top-{k}: score "
                         f"with teacher top_k >= {top_k}")
    assert signals.teacher_topk_lp_teacher is not None
    assert signals.teacher_topk_lp_student is not None
    full_t, full_s = signals.teacher_topk_lp_teacher, signals.teacher_topk_lp_student
    lp_t, lp_s = full_t[..., :top_k], full_s[..., :top_k]
    pair = (lp_t, lp_s) if direction == "forward" else (lp_s, lp_t)
    if tail == "none":
        return TopKDivergence(truncated_kl(*pair))
    if tail == "renormalize":
        return TopKDivergence(renormalized_kl(*pair))
    exact_t, exact_s = signals.teacher_topk_tail_teacher, signals.teacher_topk_tail_student
    tail_t = None if exact_t is None else prefix_tail(full_t, exact_t, top_k)
    tail_s = None if exact_s is None else prefix_tail(full_s, exact_s, top_k)
    floored = torch.zeros_like(signals.valid)
    for lp, exact in ((lp_t, tail_t), (lp_s, tail_s)):
        if exact is None:
            floored = floored | tail_floored(lp.detach())
    tails = (tail_t, tail_s) if direction == "forward" else (tail_s, tail_t)
    kl = bucket_kl(*pair, tail_from=tails[0], tail_to=tails[1])
    return TopKDivergence(kl, tail_exact_teacher=exact_t is not None, tail_floored=floored)


def teacher_topk_kl(signals: TokenSignals, top_k: int, direction: str = "forward",
                    tail: str = "lumped") -> torch.Tensor:
    """:func:`teacher_topk_divergence`'s float32 ``[B, T]`` value alone."""
    return teacher_topk_divergence(signals, top_k, direction, tail).kl


@OBJECTIVES.register("topk_kl")
@dataclass
class TopKKL(Objective):
    """A KL on the teacher's top-K ids (module docstring), per kept token.

    Attributes:
        direction: ``forward`` = KL(pi_T || pi_S) (verl, NeMo-RL) or ``reverse`` =
            KL(pi_S || pi_T) (the direction of OPD's Eq. 1, restricted to the teacher's top-K).
        top_k: K (32, verl's; NeMo-RL uses 64). The signals must hold at least K ids.
        tail: the rest of the vocabulary: ``lumped`` (one tail bucket, ours, the default),
            ``none`` (ignored: verl's loss, forward) or ``renormalize`` (both lists
            renormalised: NeMo-RL's default).
    """

    label = "top-k KL"

    direction: str = "forward"
    top_k: int = 32
    tail: str = "lumped"
    requires = TEACHER_TOPK_FIELDS

    def __post_init__(self) -> None:
        check_choice("direction", self.direction, KL_DIRECTIONS, owner="TopKKL")
        check_int("top_k", self.top_k, owner="TopKKL")
        check_choice("tail", self.tail, TOPK_TAILS, owner="TopKKL")

    def token_loss(self, signals: TokenSignals, result: FilterResult) -> ObjectiveOutput:
        div = teacher_topk_divergence(signals, self.top_k, self.direction, self.tail)
        metrics = {f"kl_topk_{self.direction}": masked_mean(div.kl, signals.valid)}
        metrics.update(div.metrics(signals.valid))
        return ObjectiveOutput(loss=div.kl, metrics=metrics)


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

    label = "Entropy-Aware OPD"
    table_order = 50
    standalone = True

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
        div = teacher_topk_divergence(signals, self.top_k, "forward")
        fkl = div.kl
        gate = signals.entropy_teacher > self.entropy_threshold  # [B, T]
        zero = torch.zeros((), dtype=fkl.dtype, device=fkl.device)
        out.loss = out.loss + self.coef * torch.where(gate, fkl, zero)
        out.metrics["kl_topk_forward"] = masked_mean(fkl, signals.valid)
        out.metrics.update(div.metrics(signals.valid))
        out.metrics["entropy_gated_share"] = masked_mean(gate.float(), signals.valid)
        return out
