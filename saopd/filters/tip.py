"""TIP (arXiv 2604.14084): keep the most important tokens of each response.

As reproduced in ``BASELINES.md`` (the official selector was not found):
h = H_S / ln|Vocab| clipped at the batch's ``entropy_clip_quantile`` (98th percentile);
d = per-token KL(pi_S || pi_T); both min-max normalised over the valid tokens of the batch (a
quantity whose spread is float32 rounding noise, ``saopd.filters.spread``, maps to zeros);
score s = h + d - h*d (a soft OR); keep the top floor(rho * L_i) tokens of each response i.

The division by ln|Vocab| is omitted because min-max normalisation cancels any positive scale.
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
from saopd.filters.spread import min_max_normalize
from saopd.validation import check_fraction


def tip_scores(entropy_student: torch.Tensor, kl: torch.Tensor, valid: torch.Tensor, *,
               clip_quantile: float = 0.98) -> torch.Tensor:
    """TIP's soft-OR importance s = h + d - h*d. Inputs and output float [B, T]; invalid -> -inf."""
    h = entropy_student.detach().float()[valid]  # [N]
    d = kl.detach().float()[valid]  # [N]
    if h.numel() == 0:
        return torch.full(valid.shape, float("-inf"), device=valid.device)
    h = torch.minimum(h, torch.quantile(h, clip_quantile))
    h, d = min_max_normalize(h), min_max_normalize(d)
    s = h + d - h * d
    return torch.where(valid, scatter_valid(s, valid), torch.tensor(float("-inf"),
                                                                     device=valid.device))


def per_row_top_k(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Bool [B, T]: the k[i] highest scores of each row i (ties by position). k: int [B]."""
    order = torch.sort(scores, dim=1, stable=True, descending=True).indices  # [B, T]
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(scores.shape[1], device=scores.device).expand_as(order))
    return ranks < k[:, None]


@FILTERS.register("tip")
@dataclass
class TIPFilter(TokenFilter):
    """TIP: per response keep the floor(rho * L_i) tokens with the largest soft-OR score.

    Attributes:
        rho: kept share of each response's tokens (TIP's default 0.5; 0.2 also reported).
        entropy_clip_quantile: clip H_S at this batch quantile before normalising (0.98).
    """

    label = "TIP"
    table_order = 30

    rho: float = 0.5
    entropy_clip_quantile: float = 0.98
    requires = ("entropy_student", "kl")

    def __post_init__(self) -> None:
        check_fraction("rho", self.rho, owner="TIPFilter")
        check_fraction("entropy_clip_quantile", self.entropy_clip_quantile, owner="TIPFilter")

    def apply(self, signals, *, generator: torch.Generator | None = None) -> FilterResult:
        assert signals.entropy_student is not None and signals.kl is not None
        valid = signals.valid
        scores = tip_scores(signals.entropy_student, signals.kl, valid,
                            clip_quantile=self.entropy_clip_quantile)
        k = torch.floor(valid.sum(dim=1).double() * self.rho).long()  # [B]
        keep = per_row_top_k(scores, k) & valid
        return result_from_filtered(signals, valid & ~keep)
