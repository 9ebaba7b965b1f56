"""SA-OPD's filter (Eq. 16-18) and Algorithm 2, against hand computations and a reference."""

from __future__ import annotations

import dataclasses
import itertools
import math
from fractions import Fraction

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from saopd.filters import FILTERS, spurious_token_mask
from saopd.filters.base import filtered_loss_mass_ratio
from saopd.filters.ranks import count_for, decimal
from saopd.signals import TokenSignals
from tests.conftest import TOTAL, hand_signals, mask_of  # the hand-made batch


def run(**kw: object):
    s = hand_signals()
    return spurious_token_mask(s.a_full, s.grounding_gap, s.valid, p1=0.5, p2=0.5, **kw)


def test_fixed_ratio_filter_abs() -> None:
    out = run()
    assert out.mask.tolist() == mask_of({0})
    assert out.flmr == pytest.approx(2.0 / TOTAL, rel=1e-6)
    assert (out.alpha, out.branch) == (1.0, "fixed")


def test_fixed_ratio_filter_two_sided() -> None:
    out = run(extreme="two_sided")
    assert out.mask.tolist() == mask_of({0, 1, 3})
    assert out.flmr == pytest.approx((2.0 + 0.5 + 0.1) / TOTAL, rel=1e-6)


def test_branch_within_bound_keeps_alpha_one() -> None:
    out = run(beta_min=0.1, beta_max=0.3)  # r(1) = 0.2198
    assert (out.branch, out.alpha) == ("within", 1.0)
    assert out.mask.tolist() == mask_of({0})


def test_branch_shrink() -> None:
    # r(1) = 0.22 > 0.1. For alpha < 1, k = floor(3 alpha) <= 2: Bottom_2(gap) = {t3, t0} and
    # Top_2(|A|) = {t2, t4} are disjoint, so the largest feasible set is empty and alpha -> 1^-.
    out = run(beta_max=0.1)
    assert out.branch == "shrink"
    assert out.mask.tolist() == mask_of(set())
    assert out.flmr == 0.0
    assert 1.0 - 1e-9 < out.alpha < 1.0


def test_branch_grow() -> None:
    # r(1) = 0.22 < 0.5; alpha_max = 2. k = floor(3 alpha):
    #   k = 4 (alpha = 4/3): Bottom_4 = {t3,t0,t1,t4}, Top_4 = {t2,t4,t0,t5} -> {t0,t4}, r = 4.5/9.1
    #   k = 5 (alpha = 5/3): Bottom_5 adds t5, Top_5 adds t1 -> {t0,t1,t4,t5}, r = 6.0/9.1 >= 0.5
    out = run(beta_min=0.5, beta_max=0.9)
    assert out.branch == "grow"
    assert out.mask.tolist() == mask_of({0, 1, 4, 5})
    assert out.flmr == pytest.approx(6.0 / TOTAL, rel=1e-6)
    assert out.alpha == pytest.approx(5 / 3, rel=1e-9)
    assert count_for(0.5, 6, out.alpha) == 5
    assert (out.p1, out.p2) == (pytest.approx(5 / 6), pytest.approx(5 / 6))


def test_branch_grow_then_shrink() -> None:
    # growing reaches r = 6.0/9.1 = 0.659 > beta_max = 0.55; the largest alpha with r <= 0.55
    # is just below 5/3, where F = {t0, t4} (r = 4.5/9.1 = 0.4945).
    out = run(beta_min=0.5, beta_max=0.55)
    assert out.branch == "grow_then_shrink"
    assert out.mask.tolist() == mask_of({0, 4})
    assert out.flmr == pytest.approx(4.5 / TOTAL, rel=1e-6)
    assert 4 / 3 <= out.alpha < 5 / 3


def test_unreachable_lower_bound_keeps_alpha_one() -> None:
    zeros = torch.zeros(1, 4)
    out = spurious_token_mask(zeros, zeros, torch.ones(1, 4, dtype=torch.bool), p1=0.5, p2=0.5,
                              beta_min=0.1)
    assert (out.branch, out.alpha, out.flmr) == ("unreachable", 1.0, 0.0)


# ---- a plain reference of Algorithm 2 over every reachable set ------------------------------
def ref_set(a: list[float], d: list[float], p1: float, p2: float, alpha: Fraction,
            extreme: str) -> set[int]:
    n = len(a)
    k1, k2 = count_for(p1, n, alpha), count_for(p2, n, alpha)
    by_gap = sorted(range(n), key=lambda i: (d[i], i))[:k1]
    if extreme == "abs":
        ext = set(sorted(range(n), key=lambda i: (-abs(a[i]), i))[:k2])
    else:
        ext = set(sorted(range(n), key=lambda i: (-a[i], i))[:k2])
        ext |= set(sorted(range(n), key=lambda i: (a[i], i))[:k2])
    return set(by_gap) & ext


def ref_flmr(a: list[float], f: set[int]) -> float:
    return sum(abs(a[i]) for i in f) / (sum(abs(x) for x in a) + 1e-8)


def float_alpha(x: Fraction) -> Fraction:
    """The smallest float64 >= x, exactly. The filter's alpha is a float: where the breakpoints
    of two ratios lie between the same two adjacent floats (p1 = 1/3, read as the decimal
    0.3333333333333333, jumps 2e-16 after p2 = 0.5 at n = 5), the set a real alpha in between
    would select is not one any float alpha selects."""
    f = float(x)
    return Fraction(f if Fraction(f) >= x else math.nextafter(f, math.inf))


def alphas_between(lo: Fraction, hi: Fraction, n: int, p1: float, p2: float) -> list[Fraction]:
    """Every float breakpoint of (k1, k2) in [lo, hi] plus midpoints, exactly: all the sets a
    float alpha reaches.

    The ratios are read as the decimals they were written as (0.15 = 3/20), as the filter does.
    """
    pts = {lo, hi}
    for p in (decimal(p1), decimal(p2)):
        steps = (float_alpha(j / (p * n)) for j in range(1, n + 1))
        pts |= {x for x in steps if lo <= x <= hi}
    pts_sorted = sorted(pts)
    return sorted(set(pts_sorted) | {Fraction(float((x + y) / 2))
                                     for x, y in itertools.pairwise(pts_sorted)})


def reference_algorithm2(a, d, p1, p2, beta_min, beta_max, extreme) -> set[int]:
    def r(alpha: Fraction) -> float:
        return ref_flmr(a, ref_set(a, d, p1, p2, alpha, extreme))

    n, one = len(a), Fraction(1)
    if beta_max is not None and r(one) > beta_max:
        ok = [x for x in alphas_between(Fraction(0), one, n, p1, p2) if r(x) <= beta_max]
        return ref_set(a, d, p1, p2, max(ok), extreme)
    if beta_min is not None and r(one) < beta_min:
        amax = max(one, float_alpha(1 / decimal(p1)), float_alpha(1 / decimal(p2)))
        up = [x for x in alphas_between(one, amax, n, p1, p2) if r(x) >= beta_min]
        if not up:
            return ref_set(a, d, p1, p2, one, extreme)
        grown = min(up)
        if beta_max is not None and r(grown) > beta_max:
            ok = [x for x in alphas_between(Fraction(0), grown, n, p1, p2) if r(x) <= beta_max]
            return ref_set(a, d, p1, p2, max(ok), extreme)
        return ref_set(a, d, p1, p2, grown, extreme)
    return ref_set(a, d, p1, p2, one, extreme)


@settings(max_examples=150, deadline=None)
@given(
    data=st.lists(st.tuples(st.integers(-8, 8), st.integers(0, 6)), min_size=1, max_size=24),
    p1=st.sampled_from([0.1, 0.2, 0.35, 0.5, 1.0, 1 / 3]),
    p2=st.sampled_from([0.15, 0.3, 0.5, 0.8]),
    bounds=st.sampled_from([(None, None), (None, 0.05), (None, 0.2), (0.3, None), (0.3, 0.5),
                            (0.1, 0.12), (0.6, 0.9), (0.0, 0.0)]),
    extreme=st.sampled_from(["abs", "two_sided"]),
)
def test_matches_reference_algorithm2(data, p1, p2, bounds, extreme) -> None:
    # integer-valued signals in quarters: exact in float32, with many ties
    a = [x / 4 for x, _ in data]
    d = [y / 4 for _, y in data]
    beta_min, beta_max = bounds
    valid = torch.ones(1, len(a), dtype=torch.bool)
    out = spurious_token_mask(torch.tensor([a]), torch.tensor([d]), valid, p1=p1, p2=p2,
                              beta_min=beta_min, beta_max=beta_max, extreme=extreme)
    expected = reference_algorithm2(a, d, p1, p2, beta_min, beta_max, extreme)
    assert set(out.mask[0].nonzero()[:, 0].tolist()) == expected
    assert out.flmr == pytest.approx(ref_flmr(a, expected), abs=1e-6)
    if beta_max is not None:
        assert out.flmr <= beta_max  # always feasible: alpha = 0 filters nothing


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), beta_max=st.floats(0.0, 0.3))
def test_flmr_never_exceeds_beta_max(seed: int, beta_max: float) -> None:
    g = torch.Generator().manual_seed(seed)
    a, d = torch.randn(8, 64, generator=g), torch.rand(8, 64, generator=g)
    valid = torch.rand(8, 64, generator=g) < 0.7
    for beta_min in (None, beta_max / 2, beta_max):
        out = spurious_token_mask(a, d, valid, p1=0.2, p2=0.3, beta_min=beta_min,
                                  beta_max=beta_max)
        assert out.flmr <= beta_max
        assert not (out.mask & ~valid).any()


def test_p1_zero_filters_nothing_and_equals_vanilla_opd() -> None:
    s = hand_signals()
    sa = FILTERS.build("sa_opd", p1=0.0, p2=0.3, beta_min=0.5)(s)
    none = FILTERS.build("none")(s)
    assert torch.equal(sa.keep, none.keep) and torch.equal(sa.weights, none.weights)
    assert sa.stats["flmr"] == 0.0


def test_filter_stats_describe_the_set() -> None:
    res = FILTERS.build("sa_opd", p1=0.5, p2=0.5)(hand_signals())
    st_ = res.stats
    assert st_["n_valid"] == 6 and st_["n_filtered"] == 1
    assert st_["filtered_ratio"] == pytest.approx(1 / 6)
    assert st_["abs_a_filtered"] == pytest.approx(2.0)
    assert st_["abs_a_kept"] == pytest.approx((TOTAL - 2.0) / 5, rel=1e-6)
    assert st_["grounding_gap_filtered"] == pytest.approx(0.1, abs=1e-6)
    assert st_["grounding_gap_kept"] == pytest.approx((0.1 + 3.0 + 0.0 + 0.2 + 2.0) / 5, abs=1e-6)
    assert res.keep.tolist() == [[False, True, True, True, True, True, False]]
    assert res.filtered.tolist() == mask_of({0})
    assert "entropy_student_filtered" not in st_  # no H_S computed, none reported


def test_filter_stats_entropy_of_filtered_and_kept() -> None:
    """F = {t0} on the hand batch; H_S = 0.5 at t0, 1..5 at t1..t5, 9 at the padding column."""
    signals = dataclasses.replace(
        hand_signals(), entropy_student=torch.tensor([[0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 9.0]]))
    st_ = FILTERS.build("sa_opd", p1=0.5, p2=0.5)(signals).stats
    assert st_["entropy_student_filtered"] == pytest.approx(0.5)
    assert st_["entropy_student_kept"] == pytest.approx(3.0)  # padding's 9 never enters


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"p1": 1.5}, r"p1 must be in \[0, 1\], got 1.5"),
        ({"p2": -0.1}, r"p2 must be in \[0, 1\], got -0.1"),
        ({"beta_min": 0.5, "beta_max": 0.2}, "beta_min must be <= beta_max"),
        ({"beta_max": float("nan")}, "beta_max must be in"),
        ({"extreme": "top"}, r"extreme must be one of \['abs', 'two_sided'\], got 'top'"),
    ],
)
def test_bad_hyperparameters(kwargs: dict, match: str) -> None:
    params = {"p1": 0.2, "p2": 0.3} | kwargs
    s = hand_signals()
    with pytest.raises(ValueError, match=match):
        spurious_token_mask(s.a_full, s.grounding_gap, s.valid, **params)
    with pytest.raises(ValueError, match=match):
        FILTERS.build("sa_opd", **params)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("which", ["a_full", "delta"])
@pytest.mark.parametrize("bounded", [False, True])
def test_non_finite_scores_are_refused(bad: float, which: str, bounded: bool) -> None:
    """+inf in A used to give FLMR NaN and skip Algorithm 2's bound; now it names the spot.
    A bad value at an invalid (padding) position is ignored, as every padding value is."""
    s = hand_signals()
    values = {"a_full": s.a_full.clone(), "delta": s.grounding_gap.clone()}
    bounds = {"beta_max": 0.1} if bounded else {}
    values[which][0, 6] = bad  # padding column: ignored
    out = spurious_token_mask(values["a_full"], values["delta"], s.valid, p1=0.5, p2=0.5,
                              **bounds)
    assert math.isfinite(out.flmr)
    values[which][0, 2] = bad
    match = rf"{which} has 1 non-finite value\(s\).*first at \[0, 2\]"
    with pytest.raises(ValueError, match=match):
        spurious_token_mask(values["a_full"], values["delta"], s.valid, p1=0.5, p2=0.5,
                            **bounds)
    if which == "a_full":
        with pytest.raises(ValueError, match=r"a_full has 1 non-finite"):
            filtered_loss_mass_ratio(values["a_full"], torch.zeros_like(s.valid), s.valid)


def test_shape_mismatch_and_unknown_names() -> None:
    s = hand_signals()
    with pytest.raises(ValueError, match=r"delta has shape \(1, 6\) but valid has \(1, 7\)"):
        spurious_token_mask(s.a_full, s.grounding_gap[:, :6], s.valid, p1=0.2, p2=0.3)
    with pytest.raises(ValueError, match=r"unknown filter 'sa-opd'; allowed: .*sa_opd"):
        FILTERS.build("sa-opd")
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['beta'\]"):
        FILTERS.build("sa_opd", beta=0.1)


def test_vanilla_signals_cannot_feed_sa_opd() -> None:
    s = TokenSignals(lp_student=-torch.ones(1, 3), lp_teacher=-torch.ones(1, 3),
                     valid=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="filter 'sa_opd' needs TokenSignals field"):
        FILTERS.build("sa_opd")(s)
    assert math.isclose(FILTERS.build("none")(s).stats["flmr"], 0.0)


def test_coinciding_breakpoints_jump_together() -> None:
    # p1 = 0.1, p2 = 0.15 over n = 10: k1 = floor(alpha) and k2 = floor(1.5 alpha) both jump at
    # alpha = 6 (to 6 and 9). In float arithmetic 6 * 0.15 * 10 = 8.999..., so a float rule would
    # briefly give (6, 8), a set no real alpha produces; the exact decimal rule never does.
    a = [0, 0, 0, 0, 0, 0, 0.25, 0, 0.25, 0.25]
    d = [0, 0, 0, 0, 0.25, 0, 0, 0, 0, 0]
    out = spurious_token_mask(torch.tensor([a]), torch.tensor([d]),
                              torch.ones(1, 10, dtype=torch.bool), p1=0.1, p2=0.15, beta_min=0.3)
    assert out.branch == "grow"
    assert out.mask[0].nonzero()[:, 0].tolist() == [0, 1, 2, 3, 5, 6]  # Bottom_6 ∩ Top_9
    assert count_for(0.1, 10, out.alpha) == 6 and count_for(0.15, 10, out.alpha) == 9


def _certain_and_spurious_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[2, 20]: 14 tokens per row certain for both models (|A| and gap ~1e-4), 3 spurious
    (|A| 2-3, gap 0.01-0.03) and 3 grounded (|A| 1.5-2.5, gap 1-2): low-entropy text."""
    a = torch.full((2, 20), 1e-4)
    gap = torch.full((2, 20), 1e-4)
    a[:, 14:17] = torch.tensor([2.0, -3.0, 2.5])
    gap[:, 14:17] = torch.tensor([0.01, 0.02, 0.03])
    a[:, 17:] = torch.tensor([1.5, -2.5, 2.0])
    gap[:, 17:] = torch.tensor([1.0, 2.0, 1.5])
    return a, gap, torch.ones(2, 20, dtype=torch.bool)


def test_divergent_ranks_find_what_certain_tokens_hide() -> None:
    """The paper's rule ranks over all valid tokens: the 28 certain tokens fill Bottom_0.2(gap)
    and nothing is removed. Ranked over |A| > floor (saopd's extension), the 12 divergent tokens
    give k1 = floor(0.5 * 12) = 6 smallest gaps (the spurious ones) and k2 = floor(0.5 * 12) = 6
    largest |A|: the spurious tokens with |A| >= 2.5 and the grounded ones outside Bottom_p1."""
    a, gap, valid = _certain_and_spurious_batch()
    paper = spurious_token_mask(a, gap, valid, p1=0.2, p2=0.3)
    assert not paper.mask.any()
    ext = spurious_token_mask(a, gap, valid, p1=0.5, p2=0.5, rank_over="divergent",
                              divergence_floor=0.05)
    # Top_6(|A|) of the 12: |A| = 3.0 x2, 2.5 x4 (spurious 15, 16 and grounded 18 per row);
    # Bottom_6(gap): the 6 spurious; their intersection: positions 15 and 16 of each row
    expected = torch.zeros(2, 20, dtype=torch.bool)
    expected[:, 15:17] = True
    assert torch.equal(ext.mask, expected)
    assert not ext.mask[a.abs() <= 0.05].any()
    assert ext.mask.any()
    # FLMR is the share of the whole batch's |A| mass, certain tokens included
    assert ext.flmr == pytest.approx(filtered_loss_mass_ratio(a, ext.mask, valid), rel=1e-6)
    # the paper's rule at the same ratios: Top_20(|A|) of the 40 reaches into the certain tokens
    # (ties), and Bottom_20(gap) is all certain: it removes certain tokens, no spurious one
    paper = spurious_token_mask(a, gap, valid, p1=0.5, p2=0.5).mask
    assert paper.any() and not paper[a.abs() > 0.05].any()


def test_divergent_ranks_with_nothing_above_the_floor_filter_nothing() -> None:
    a, gap, valid = _certain_and_spurious_batch()
    out = spurious_token_mask(a, gap, valid, p1=0.5, p2=0.5, rank_over="divergent",
                              divergence_floor=10.0, beta_min=0.05)
    assert not out.mask.any() and out.flmr == 0.0


@pytest.mark.parametrize("kwargs, match", [
    ({"rank_over": "some"}, "rank_over"),
    ({"divergence_floor": -0.1}, "divergence_floor"),
    ({"divergence_floor": float("nan")}, "divergence_floor"),
])
def test_bad_rank_options(kwargs: dict, match: str) -> None:
    a, gap, valid = _certain_and_spurious_batch()
    with pytest.raises(ValueError, match=match):
        spurious_token_mask(a, gap, valid, p1=0.2, p2=0.3, **kwargs)
    with pytest.raises(ValueError, match=match):
        FILTERS.build("sa_opd", **kwargs)
