"""Rank-based selections against a plain Python reference (sorted by (value, index))."""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

from saopd.filters.ranks import IntersectionPath, ascending_ranks, largest_k_mask, smallest_k_mask


def reference_ranks(values: list[float], descending: bool = False) -> list[int]:
    sign = -1.0 if descending else 1.0
    order = sorted(range(len(values)), key=lambda i: (sign * values[i], i))
    ranks = [0] * len(values)
    for r, i in enumerate(order):
        ranks[i] = r
    return ranks


# values drawn from a small set so that ties are frequent; -0.0 and 0.0 must tie
tied_values = st.lists(st.sampled_from([-2.0, -0.5, -0.0, 0.0, 0.25, 1.0, 3.0]), min_size=1,
                       max_size=40)


@settings(max_examples=200, deadline=None)
@given(values=tied_values, frac=st.floats(0, 1), descending=st.booleans())
def test_ranks_match_reference_with_ties(values: list[float], frac: float,
                                         descending: bool) -> None:
    k = int(frac * len(values))
    ref = reference_ranks(values, descending)
    assert ascending_ranks(torch.tensor(values), descending=descending).tolist() == ref
    select = largest_k_mask if descending else smallest_k_mask
    assert select(torch.tensor(values), k).tolist() == [r < k for r in ref]


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.floats(allow_nan=False, width=32), min_size=1, max_size=60))
def test_ranks_follow_float_order_over_the_whole_range(values: list[float]) -> None:
    # infinities, subnormals, huge and tiny magnitudes of both signs
    assert ascending_ranks(torch.tensor(values)).tolist() == reference_ranks(values)


def test_ties_are_broken_by_position() -> None:
    x = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    assert smallest_k_mask(x, 3).tolist() == [True, True, False, True, False]
    assert largest_k_mask(x, 2).tolist() == [True, False, True, False, False]


def test_path_mass_is_monotone_in_alpha() -> None:
    g = torch.Generator().manual_seed(3)
    low, a = torch.rand(50, generator=g), torch.randn(50, generator=g)
    for extreme in ("abs", "two_sided"):
        path = IntersectionPath(low, a, a.abs(), 0.3, 0.4, extreme=extreme)
        masses = [path.mass(x / 20) for x in range(61)]
        assert masses == sorted(masses)
        assert masses[-1] > 0
