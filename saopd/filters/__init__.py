"""Token filters: which valid tokens carry OPD loss. One registry, :data:`FILTERS`.

Importing this package registers every filter: ``none`` (vanilla OPD), ``sa_opd``, the ablations
``random``, ``divergence_only``, ``ig_only``, ``proxy_replacement``, and the baselines ``tip``,
``fire`` and ``teachability`` (Token Teachability / TA-OPD), and the testbeds' positive control
``oracle`` (never a method).
"""

from saopd.filters import (  # noqa: F401  (registration)
    ablations,
    fire,
    none,
    oracle,
    sa_opd,
    teachability,
    tip,
)
from saopd.filters.base import (
    FILTERS,
    FilterResult,
    TokenFilter,
    filter_stats,
    filtered_loss_mass_ratio,
)
from saopd.filters.sa_opd import SAOPDFilter, SpuriousMask, spurious_token_mask
from saopd.filters.teachability import TeachabilityFilter, teachability_scores

__all__ = [
    "FILTERS",
    "FilterResult",
    "SAOPDFilter",
    "SpuriousMask",
    "TeachabilityFilter",
    "TokenFilter",
    "filter_stats",
    "filtered_loss_mass_ratio",
    "spurious_token_mask",
    "teachability_scores",
]
