"""Vanilla OPD: no token is filtered (paper Eq. 1-3)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from saopd.filters.base import FILTERS, FilterResult, TokenFilter, result_from_filtered
from saopd.signals.token_signals import TokenSignals


@FILTERS.register("none")
@dataclass
class NoFilter(TokenFilter):
    """Keep every valid token: the loss of vanilla OPD."""

    def apply(self, signals: TokenSignals, *,
              generator: torch.Generator | None = None) -> FilterResult:
        return result_from_filtered(signals, torch.zeros_like(signals.valid))
