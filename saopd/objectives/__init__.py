"""Objectives (per-token OPD losses) and the one aggregation function.

Registered: ``sampled`` (vanilla OPD estimator, optional truncated importance ratio), ``full_kl``
(exact reverse KL over the vocabulary, Eq. 19) and ``exopd`` (ExOPD reward extrapolation).
"""

from saopd.choices import AGGREGATIONS
from saopd.objectives import full_kl, sampled  # noqa: F401  (registration)
from saopd.objectives.aggregation import aggregate
from saopd.objectives.base import OBJECTIVES, Objective, ObjectiveOutput, build_objective
from saopd.objectives.sampled import ExOPD, SampledOPD, sampled_opd_loss

__all__ = [
    "AGGREGATIONS",
    "OBJECTIVES",
    "ExOPD",
    "Objective",
    "ObjectiveOutput",
    "SampledOPD",
    "aggregate",
    "build_objective",
    "sampled_opd_loss",
]
