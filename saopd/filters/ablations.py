"""The paper's ablation filters (Sec. 4.3, Table 3), each calibrated to a filtered share.

Every ablation removes about as many tokens as SA-OPD (Table 3 compares them at equal filtered
share). The share is either fixed (``share``) or matched to what SA-OPD, with the ``p1``, ``p2``,
``beta_*`` and ``extreme`` fields, removes on the same batch (``match_sa_opd``, the default).

- ``random``: a uniformly random subset of the valid tokens.
- ``divergence_only``: the tokens with the largest |A_full| (Top_p(|A_full|)).
- ``ig_only``: the tokens with the smallest grounding gap (Bottom_p(Delta^IG)).
- ``proxy_replacement``: SA-OPD's rule with the divergence in the grounding gap replaced by the
  teacher log-prob, Delta' = |lpT - lpT_res|, i.e. Bottom_p1(Delta') ∩ Top_p2(|A_full|); when
  calibrated, p1 and p2 are scaled by a common alpha until the count matches.
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
from saopd.filters.ranks import (
    IntersectionPath,
    alpha_to_fill,
    count_for,
    largest_k_mask,
    smallest_k_mask,
)
from saopd.filters.sa_opd import SAOPDParams
from saopd.signals.token_signals import TokenSignals
from saopd.validation import check_fraction

_RESIDUAL = ("lp_student_res", "lp_teacher_res")


@dataclass
class CalibratedFilter(SAOPDParams, TokenFilter):
    """Base of the ablations: how many tokens to remove on a batch.

    Attributes:
        share: fixed filtered share of the valid tokens, in [0, 1]; floor(share * N) tokens.
        match_sa_opd: remove exactly as many tokens as SA-OPD (with this object's p1, p2,
            beta_min, beta_max, extreme) removes on the same batch. Ignored when ``share`` is set.
    """

    share: float | None = None
    match_sa_opd: bool = True
    uncalibrated_ok = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.share is not None:
            check_fraction("share", self.share, owner=type(self).__name__)
        elif not self.match_sa_opd and not self.uncalibrated_ok:
            raise ValueError(
                f"filter {self.name!r} needs a filtered share: set share in [0, 1] or "
                "match_sa_opd=true"
            )

    @property
    def calibrated(self) -> bool:
        return self.share is not None or self.match_sa_opd

    @property
    def needs(self) -> tuple[str, ...]:
        extra = _RESIDUAL if self.share is None and self.match_sa_opd else ()
        return tuple(dict.fromkeys(self.requires + extra))

    def target_count(self, signals: TokenSignals) -> int:
        """Number of valid tokens to remove on this batch."""
        if self.share is not None:
            return count_for(self.share, signals.num_valid)
        return int(self.spurious_mask(signals).mask.sum())


@FILTERS.register("random")
@dataclass
class RandomFilter(CalibratedFilter):
    """Remove a uniformly random subset of the valid tokens (Table 3, "Random")."""

    label = "Random Filter"
    table_order = 60

    def apply(self, signals: TokenSignals, *,
              generator: torch.Generator | None = None) -> FilterResult:
        k = self.target_count(signals)
        device = generator.device if generator is not None else signals.valid.device
        keys = torch.rand(signals.num_valid, generator=generator, device=device)  # [N]
        filtered = smallest_k_mask(keys.to(signals.valid.device), k)
        return result_from_filtered(signals, scatter_valid(filtered, signals.valid))


@FILTERS.register("divergence_only")
@dataclass
class DivergenceOnlyFilter(CalibratedFilter):
    """Remove the tokens with the largest |A_full| (Table 3, "Divergence-only")."""

    label = "Divergence-only Filter"
    table_order = 70

    def apply(self, signals: TokenSignals, *,
              generator: torch.Generator | None = None) -> FilterResult:
        k = self.target_count(signals)
        filtered = largest_k_mask(signals.a_full.abs()[signals.valid], k)
        return result_from_filtered(signals, scatter_valid(filtered, signals.valid))


@FILTERS.register("ig_only")
@dataclass
class InputGroundednessOnlyFilter(CalibratedFilter):
    """Remove the tokens with the smallest grounding gap (Table 3, "IG-only")."""

    label = "Input-Groundedness-only Filter"
    table_order = 80

    requires = _RESIDUAL

    def apply(self, signals: TokenSignals, *,
              generator: torch.Generator | None = None) -> FilterResult:
        k = self.target_count(signals)
        filtered = smallest_k_mask(signals.grounding_gap[signals.valid], k)
        return result_from_filtered(signals, scatter_valid(filtered, signals.valid))


@FILTERS.register("proxy_replacement")
@dataclass
class ProxyReplacementFilter(CalibratedFilter):
    """SA-OPD with Delta' = |lpT - lpT_res| in place of the grounding gap (Table 3, "Proxy").

    Uncalibrated (``share=None, match_sa_opd=False``) it is SA-OPD's rule, bound included, on
    Delta'. Calibrated, alpha (scaling p1 and p2 together) is chosen so that |F| is the closest
    reachable count to the target.
    """

    label = "Proxy Replacement"
    table_order = 90

    requires = _RESIDUAL
    uncalibrated_ok = True

    def apply(self, signals: TokenSignals, *,
              generator: torch.Generator | None = None) -> FilterResult:
        assert signals.lp_teacher_res is not None
        proxy = (signals.lp_teacher - signals.lp_teacher_res).abs()  # [B, T]
        if not self.calibrated:
            out = self.spurious_mask(signals, delta=proxy)
            return result_from_filtered(signals, out.mask, alpha=out.alpha, p1=out.p1,
                                        p2=out.p2)
        target = self.target_count(signals)
        valid = signals.valid
        n = signals.num_valid
        if n == 0 or self.p1 == 0.0 or self.p2 == 0.0:
            return result_from_filtered(signals, torch.zeros_like(valid), alpha=1.0,
                                        p1=self.p1, p2=self.p2)
        alpha_max = max(1.0, alpha_to_fill(self.p1), alpha_to_fill(self.p2))
        ones = torch.ones(n, device=valid.device)
        path = IntersectionPath(proxy[valid], signals.a_full[valid], ones, self.p1, self.p2,
                                extreme=self.extreme)
        below = path.largest_alpha_at_most(0.0, alpha_max, float(target))
        above = path.smallest_alpha_at_least(0.0, alpha_max, float(target))
        alpha = below
        if above is not None and abs(path.mass(above) - target) < abs(path.mass(below) - target):
            alpha = above
        filtered = scatter_valid(path.mask(alpha), valid)
        return result_from_filtered(signals, filtered, alpha=alpha,
                                    p1=min(alpha * self.p1, 1.0), p2=min(alpha * self.p2, 1.0))
