"""Token filters: which valid tokens carry OPD loss. One registry, :data:`FILTERS`.

Importing this package registers every filter: ``none`` (vanilla OPD), ``sa_opd``, the ablations
``random``, ``divergence_only``, ``ig_only``, ``proxy_replacement``, and the baselines ``tip`` and
``fire``.
"""

from saopd.filters import ablations, fire, none, sa_opd, tip  # noqa: F401  (registration)
from saopd.filters.base import (
    FILTERS,
    FilterResult,
    TokenFilter,
    build_filter,
    filter_stats,
    filtered_loss_mass_ratio,
)
from saopd.filters.sa_opd import SAOPDFilter, SpuriousMask, spurious_token_mask

__all__ = [
    "FILTERS",
    "FilterResult",
    "SAOPDFilter",
    "SpuriousMask",
    "TokenFilter",
    "build_filter",
    "filter_stats",
    "filtered_loss_mass_ratio",
    "spurious_token_mask",
]
