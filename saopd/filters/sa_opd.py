"""SA-OPD's spurious-token filter (paper Eq. 14-18, Algorithm 1 line "construct candidate set",
Algorithm 2 "adaptive FLMR-constrained filtering").

A token is *spurious* when its teacher-student divergence is large (high update impact) but barely
depends on the input (small input-grounding gap):

    F(p1, p2) = Bottom_p1(Delta^IG) ∩ E_p2(A_full)                          (Eq. 16)

with ``E = Top_p2(|A_full|)`` (``extreme="abs"``, Eq. 16) or ``Top_p2(A) ∪ Bottom_p2(A)``
(``extreme="two_sided"``, Algorithm 2), rank-based over the valid tokens of the whole batch
(:mod:`saopd.filters.ranks`). ``rank_over="divergent"`` is **saopd's extension, not the paper's
rule**: both ranks are taken over the valid tokens with |A_full| > ``divergence_floor`` only (the
tokens that carry divergence), so that tokens certain for both models, which have a near-zero gap
and fill Bottom_p1 on low-entropy text, cannot crowd out the ones the rule is meant to find; FLMR
stays a share of the whole batch's loss mass. With a bound [beta_min, beta_max] on the filtered
loss-mass ratio (Eq. 17-18), both ratios are scaled by a common alpha,
p_i = clip(alpha * p_i^0, 0, 1), chosen by Algorithm 2's three branches. Ranks are computed once;
the alpha searches only compare ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from saopd.choices import EXTREMES, RANK_OVER
from saopd.filters.base import (
    FILTERS,
    FLMR_EPS,
    FilterResult,
    TokenFilter,
    check_finite_at,
    result_from_filtered,
    scatter_valid,
)
from saopd.filters.ranks import IntersectionPath, alpha_to_fill, compact_valid
from saopd.signals.token_signals import TokenSignals
from saopd.validation import check_choice, check_fraction, check_positive, check_same_shape


@dataclass(frozen=True)
class SpuriousMask:
    """Output of :func:`spurious_token_mask`.

    Attributes:
        mask: bool [B, T], True = filtered (a member of F); always a subset of ``valid``.
        flmr: FLMR(F), Eq. 17.
        alpha: the scale applied to p1^0 and p2^0 (1.0 when no bound is set or none was needed).
        p1, p2: the effective ratios clip(alpha * p_i^0, 0, 1).
        branch: which case of Algorithm 2 decided alpha: ``"fixed"`` (no bound), ``"within"``
            (r(1) already inside the bound), ``"shrink"`` (r(1) > beta_max), ``"grow"``
            (r(1) < beta_min), ``"grow_then_shrink"`` (growing overshot beta_max), or
            ``"unreachable"`` (even alpha_max cannot reach beta_min; alpha stays 1).
    """

    mask: torch.Tensor
    flmr: float
    alpha: float
    p1: float
    p2: float
    branch: str


def _check_bounds(beta_min: float | None, beta_max: float | None) -> None:
    if beta_min is not None:
        check_fraction("beta_min", beta_min)
    if beta_max is not None:
        check_fraction("beta_max", beta_max)
    if beta_min is not None and beta_max is not None and beta_min > beta_max:
        raise ValueError(
            f"beta_min must be <= beta_max, got beta_min={beta_min} > beta_max={beta_max}"
        )


def spurious_token_mask(
    a_full: torch.Tensor,
    delta: torch.Tensor,
    valid: torch.Tensor,
    *,
    p1: float,
    p2: float,
    beta_min: float | None = None,
    beta_max: float | None = None,
    extreme: str = "abs",
    rank_over: str = "valid",
    divergence_floor: float = 0.0,
) -> SpuriousMask:
    """The SA-OPD filtered set F over a batch, with the optional adaptive FLMR bound.

    Args:
        a_full: float [B, T], A_t^full = lpS - lpT (Eq. 12). Any float dtype; used detached.
        delta: float [B, T], the grounding gap |A_full - A_res| (Eq. 14), or any other
            groundedness score where *small* means input-agnostic (the proxy ablation passes
            |lpT - lpT_res|).
        valid: bool [B, T], True = a real response token (the set V). Values elsewhere are
            ignored; at valid positions ``a_full`` and ``delta`` must be finite
            (``ValueError`` naming the first bad position otherwise).
        p1: base share of V with the smallest ``delta`` (Bottom_p1), in [0, 1].
        p2: base share of V with the most extreme A_full (Top_p2), in [0, 1].
        beta_min, beta_max: optional FLMR interval of Algorithm 2, fractions in [0, 1]
            (the paper's "beta = 1.8" percentage points is ``beta_max=0.018``). ``None`` = no
            bound on that side; with both ``None`` this is the fixed-ratio rule of Eq. 16.
        extreme: ``"abs"`` (Top_p2(|A|), Eq. 16) or ``"two_sided"`` (Top_p2(A) ∪ Bottom_p2(A),
            Algorithm 2).
        rank_over: ``"valid"`` (the paper: p1, p2 are shares of V) or ``"divergent"`` (saopd's
            extension: shares of the valid tokens with |A_full| > ``divergence_floor``; tokens at
            or below the floor are never filtered). FLMR is over all of V either way.
        divergence_floor: the floor on |A_full| (nats, >= 0) of ``rank_over="divergent"``.

    Returns:
        :class:`SpuriousMask` with ``.mask`` (True = filtered), ``.flmr`` and ``.alpha``.

    Algorithm 2 (with r(alpha) = FLMR(F_alpha), non-decreasing in alpha because rank sets are
    nested): if r(1) > beta_max, alpha = the largest alpha in [0, 1] with r <= beta_max; if
    r(1) < beta_min, alpha = the smallest alpha in [1, alpha_max] with r >= beta_min, where
    alpha_max = max(1, 1/p1, 1/p2), and if that overshoots beta_max, the largest alpha in
    [0, alpha_max] with r <= beta_max. With p1 = 0 or p2 = 0, F is empty for every alpha.
    alpha is a float64 (p1, p2 read as the decimals they were written as): where the steps of
    k1 and k2 fall between the same two adjacent floats (p1 = 1/3 and p2 = 0.5 at N = 5), the
    set a real alpha between them would select is not one this returns.
    """
    check_fraction("p1", p1)
    check_fraction("p2", p2)
    _check_bounds(beta_min, beta_max)
    check_choice("extreme", extreme, EXTREMES)
    check_choice("rank_over", rank_over, RANK_OVER)
    check_positive("divergence_floor", divergence_floor, allow_zero=True)
    if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool:
        raise ValueError("valid must be a bool tensor of the shape of a_full")
    check_same_shape("a_full", a_full, valid.shape, "valid")
    check_same_shape("delta", delta, valid.shape, "valid")

    check_finite_at("a_full", a_full, valid)
    check_finite_at("delta", delta, valid)

    a, d = compact_valid(a_full, valid), compact_valid(delta, valid)  # [N] each, row-major
    # [N] bool: the tokens ranked (None = all of V, the paper's rule)
    ranked = a.abs() > divergence_floor if rank_over == "divergent" else None
    n = a.numel() if ranked is None else int(ranked.sum())
    adaptive = beta_min is not None or beta_max is not None
    if n == 0 or p1 == 0.0 or p2 == 0.0:
        branch = "within" if adaptive else "fixed"
        return SpuriousMask(torch.zeros_like(valid), 0.0, 1.0, p1, p2, branch)

    abs_a = a.double().abs()  # float64, as filtered_loss_mass_ratio, so bound checks agree
    total = float(abs_a.sum()) + FLMR_EPS  # over all of V, ranked or not
    weight = abs_a / total  # path.mass(alpha) is then r(alpha) = FLMR(F_alpha)
    if ranked is not None:
        a, d, weight = a[ranked], d[ranked], weight[ranked]
    path = IntersectionPath(d, a, weight, p1, p2, extreme=extreme)

    alpha, branch = 1.0, "fixed"
    if adaptive:
        r1 = path.mass(1.0)
        branch = "within"
        if beta_max is not None and r1 > beta_max:
            alpha, branch = path.largest_alpha_at_most(0.0, 1.0, beta_max), "shrink"
        elif beta_min is not None and r1 < beta_min:
            alpha_max = max(1.0, alpha_to_fill(p1), alpha_to_fill(p2))
            grown = path.smallest_alpha_at_least(1.0, alpha_max, beta_min)
            if grown is None:
                branch = "unreachable"
            elif beta_max is not None and path.mass(grown) > beta_max:
                # Algorithm 2 searches [0, alpha_max]; r is monotone and r(1) < beta_min <=
                # beta_max, so the answer lies in [1, grown]: same alpha, smaller search.
                alpha = path.largest_alpha_at_most(1.0, grown, beta_max)
                branch = "grow_then_shrink"
            else:
                alpha, branch = grown, "grow"

    compact = path.mask(alpha)
    flmr = float(weight[compact].sum())  # = filtered_loss_mass_ratio (Eq. 17), float64
    if ranked is not None:  # back from the ranked tokens to V's compact order
        compact = torch.zeros_like(ranked).masked_scatter(ranked, compact)
    return SpuriousMask(
        mask=scatter_valid(compact, valid),
        flmr=flmr,
        alpha=alpha,
        p1=min(max(alpha * p1, 0.0), 1.0),
        p2=min(max(alpha * p2, 0.0), 1.0),
        branch=branch,
    )


@dataclass
class SAOPDParams:
    """Hyperparameters of the SA-OPD rule (shared by the filter and the calibrated ablations).

    Attributes:
        p1: base share of valid tokens with the smallest grounding gap (Bottom_p1), paper 0.2.
        p2: base share with the most extreme A_full (Top_p2), paper 0.3.
        beta_min: lower FLMR bound of Algorithm 2 (fraction), or None.
        beta_max: upper FLMR bound (fraction; the paper's visual-understanding runs use 1.8
            points = 0.018), or None for the fixed-ratio rule.
        extreme: "abs" (Eq. 16) or "two_sided" (Algorithm 2).
        rank_over: "valid" (the paper's rule: shares of all valid tokens) or "divergent"
            (saopd's extension, not the paper's: shares of the valid tokens with
            |A_full| > divergence_floor; see the module docstring).
        divergence_floor: |A_full| floor in nats of ``rank_over="divergent"`` (>= 0).
    """

    p1: float = 0.2
    p2: float = 0.3
    beta_min: float | None = None
    beta_max: float | None = None
    extreme: str = "abs"
    rank_over: str = "valid"
    divergence_floor: float = 0.05

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_fraction("p1", self.p1, owner=owner)
        check_fraction("p2", self.p2, owner=owner)
        _check_bounds(self.beta_min, self.beta_max)
        check_choice("extreme", self.extreme, EXTREMES, owner=owner)
        check_choice("rank_over", self.rank_over, RANK_OVER, owner=owner)
        check_positive("divergence_floor", self.divergence_floor, owner=owner, allow_zero=True)

    def spurious_mask(self, signals: TokenSignals, delta: torch.Tensor | None = None
                      ) -> SpuriousMask:
        """Run :func:`spurious_token_mask` on ``signals`` (``delta`` defaults to Delta^IG)."""
        return spurious_token_mask(
            signals.a_full,
            signals.grounding_gap if delta is None else delta,
            signals.valid,
            p1=self.p1,
            p2=self.p2,
            beta_min=self.beta_min,
            beta_max=self.beta_max,
            extreme=self.extreme,
            rank_over=self.rank_over,
            divergence_floor=self.divergence_floor,
        )


@FILTERS.register("sa_opd")
@dataclass
class SAOPDFilter(SAOPDParams, TokenFilter):
    """SA-OPD: drop Bottom_p1(Delta^IG) ∩ Top_p2(|A_full|), optionally under an FLMR bound."""

    label = "SA-OPD"
    table_order = 100

    requires = ("lp_student_res", "lp_teacher_res")

    def apply(self, signals: TokenSignals, *,
              generator: torch.Generator | None = None) -> FilterResult:
        out = self.spurious_mask(signals)
        return result_from_filtered(signals, out.mask, alpha=out.alpha, p1=out.p1, p2=out.p2)
