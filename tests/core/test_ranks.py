"""Rank-based selections against a plain Python reference (sorted by (value, index))."""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

from saopd.filters.ranks import IntersectionPath, largest_k_mask, partial_ranks, smallest_k_mask


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
def test_partial_ranks_match_reference_with_ties(values: list[float], frac: float,
                                                 descending: bool) -> None:
    n = len(values)
    k = int(frac * n)
    ranks = partial_ranks(torch.tensor(values), k, descending=descending).tolist()
    ref = reference_ranks(values, descending)
    assert ranks == [r if r < k else n for r in ref]
    mask = (smallest_k_mask(torch.tensor(values), k, descending=descending)).tolist()
    assert mask == [r < k for r in ref]


def test_ties_are_broken_by_position() -> None:
    x = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    assert smallest_k_mask(x, 3).tolist() == [True, True, False, True, False]
    assert largest_k_mask(x, 2).tolist() == [True, False, True, False, False]


def test_path_mass_is_monotone_in_alpha() -> None:
    g = torch.Generator().manual_seed(3)
    low, a = torch.rand(50, generator=g), torch.randn(50, generator=g)
    for extreme in ("abs", "two_sided"):
        path = IntersectionPath(low, a, a.abs(), 0.3, 0.4, extreme=extreme, max_alpha=3.0)
        masses = [path.mass(x / 20) for x in range(61)]
        assert masses == sorted(masses)
        assert masses[-1] > 0
