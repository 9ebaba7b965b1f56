"""The objective interface: ``Objective(signals, filter_result) -> ObjectiveOutput``.

An objective turns the signals of the kept tokens into a per-token loss [B, T]; the one
:func:`saopd.objectives.aggregation.aggregate` function reduces it. Per-token loss is already
multiplied by the filter's weights and is exactly 0 where the filter did not keep the token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from saopd.filters.base import FilterResult
from saopd.registry import Registry
from saopd.signals.token_signals import TokenSignals


@dataclass
class ObjectiveOutput:
    """Per-token loss and detached metrics.

    Attributes:
        loss: float32 [B, T]; carries gradient into the student through ``lp_student`` (or
            ``kl``); 0 wherever the token is not kept.
        metrics: 0-d detached tensors for logging (means over the valid or kept tokens).
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Detached mean of ``values`` [B, T] over bool ``mask``; 0 for an empty mask."""
    values = values.detach()
    total = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return total.sum() / mask.sum().clamp_min(1)


class Objective:
    """Base of every objective: a dataclass whose fields are its hyperparameters.

    ``requires`` lists the :class:`TokenSignals` fields read beyond lpS, lpT and valid.

    ``label``: the objective's name in the paper's tables (None: the config name; the default
    ``sampled`` objective has none: its runs are OPD, or the filter's row); ``standalone``: the
    objective is a method by itself (ExOPD: its label names the row, where another objective's
    is appended to the filter's, ``OPD (full KL)``); ``table_order``: a standalone method's
    row's place among the methods (as :attr:`saopd.filters.base.TokenFilter.table_order`).
    Read from the registered class itself, not inherited.
    """

    name: ClassVar[str]
    requires: ClassVar[tuple[str, ...]] = ()
    label: ClassVar[str | None] = None
    standalone: ClassVar[bool] = False
    table_order: ClassVar[int | None] = None

    @property
    def needs(self) -> tuple[str, ...]:
        return self.requires

    def __call__(self, signals: TokenSignals, result: FilterResult) -> ObjectiveOutput:
        signals.require(f"objective {self.name!r}", *self.needs)
        out = self.token_loss(signals, result)
        out.loss = torch.where(result.keep, out.loss * result.weights,
                               torch.zeros((), device=out.loss.device))
        out.metrics.setdefault("kl_sampled", masked_mean(signals.a_full, signals.valid))
        return out

    def token_loss(self, signals: TokenSignals, result: FilterResult) -> ObjectiveOutput:
        raise NotImplementedError


#: Every registered class, by config name: ``OBJECTIVES.build(name, **params)`` or
#: ``OBJECTIVES.from_config(mapping)`` instantiates one (unknown names or keys raise
#: ``ValueError``).
OBJECTIVES: Registry[Objective] = Registry("objective")
