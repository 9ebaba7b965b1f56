"""Objectives (per-token OPD losses) and the one aggregation function.

Registered: ``sampled`` (vanilla OPD estimator, optional truncated importance ratio), ``full_kl``
(exact reverse KL over the vocabulary, Eq. 19), ``exopd`` (ExOPD reward extrapolation), ``topk_kl``
(forward or reverse KL on the teacher's top-K ids; the rest of the vocabulary lumped into one
tail bucket, ignored as in verl, or both lists renormalised as in NeMo-RL) and ``entropy_aware``
(Entropy-Aware OPD: sampled OPD plus the top-K forward KL where the teacher's entropy is high).
"""

from saopd.choices import AGGREGATIONS
from saopd.objectives import full_kl, sampled, topk_kl  # noqa: F401  (registration)
from saopd.objectives.aggregation import aggregate
from saopd.objectives.base import OBJECTIVES, Objective, ObjectiveOutput
from saopd.objectives.sampled import ExOPD, SampledOPD, sampled_opd_loss
from saopd.objectives.topk_kl import (
    KL_DIRECTIONS,
    TOPK_TAILS,
    EntropyAwareOPD,
    TopKKL,
    teacher_topk_kl,
)

__all__ = [
    "AGGREGATIONS",
    "KL_DIRECTIONS",
    "OBJECTIVES",
    "TOPK_TAILS",
    "EntropyAwareOPD",
    "ExOPD",
    "Objective",
    "ObjectiveOutput",
    "SampledOPD",
    "TopKKL",
    "aggregate",
    "sampled_opd_loss",
    "teacher_topk_kl",
]
