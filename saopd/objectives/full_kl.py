"""Full-vocabulary reverse KL (paper Eq. 1 and Eq. 19): loss_t = KL(pi_S(.|ctx) || pi_T(.|ctx)).

The exact per-token KL is computed by :func:`saopd.signals.logprobs.score_tokens` (``kl=True``)
in chunks over positions, with gradient through the student's logits; this objective only
masks, weights and reports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from saopd.filters.base import FilterResult
from saopd.objectives.base import OBJECTIVES, Objective, ObjectiveOutput, masked_mean
from saopd.signals.token_signals import TokenSignals


@OBJECTIVES.register("full_kl")
@dataclass
class FullReverseKL(Objective):
    """Exact reverse KL over the vocabulary at each kept position (Eq. 19's integrand)."""

    label = "full KL"

    requires = ("kl",)

    def token_loss(self, signals: TokenSignals, result: FilterResult) -> ObjectiveOutput:
        assert signals.kl is not None
        return ObjectiveOutput(loss=signals.kl,
                               metrics={"kl_full": masked_mean(signals.kl, signals.valid)})
