"""Rank-based Bottom_p / Top_p selection over the valid tokens of a batch, and the alpha search.

``BASELINES.md`` fixes the meaning of the paper's top-p selections (Eq. 16): ``Bottom_p(x)`` is
the floor(p * N) valid tokens with the smallest x, ``Top_p(x)`` the floor(p * N) with the largest,
ties broken by position (the earlier token of the row-major flattened batch wins). Working with
ranks instead of thresholds makes every selection exact and nested: Bottom_p is a subset of
Bottom_q for p <= q, so anything summed over an intersection of such sets is monotone in p.

All functions here work on *compact* 1-D tensors holding only the N valid tokens, in row-major
order of the ``[B, T]`` batch (``x[valid]``), so padding never changes a rank.

Speed: ranks come from one *stable* sort of int32 keys that preserve the float32 order (a
radix sort in PyTorch: about 10 ms for 2^20 tokens on 2 CPU cores, where a float sort takes
~85 ms). Stability is what breaks ties by index, and it is documented behaviour of
``torch.sort(stable=True)``, not an accident of the algorithm.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction

import torch


def decimal(x: float) -> Fraction:
    """The exact rational a user means by a float: ``Fraction(repr(x))`` (0.15 -> 3/20)."""
    return Fraction(repr(float(x)))


def count_for(p: float, n: int, alpha: float = 1.0) -> int:
    """Size of a rank-based selection over n tokens: floor(clip(alpha * p, 0, 1) * n).

    Computed in exact rational arithmetic, with ``p`` read as the decimal it was written as, so
    that the breakpoints of two ratios that coincide in decimal (alpha = 6 for p1 = 0.1 and
    p2 = 0.15 at n = 10) coincide exactly: float rounding would otherwise open tiny alpha
    windows where one count has jumped and the other not, sets that no real alpha produces.
    """
    share = min(max(Fraction(alpha) * decimal(p), Fraction(0)), Fraction(1))
    return math.floor(share * n)


def alpha_to_fill(p: float) -> float:
    """The smallest float alpha with alpha * p >= 1 (exactly, p read as a decimal): 1 / p."""
    exact = 1 / decimal(p)
    alpha = float(exact)
    return alpha if Fraction(alpha) >= exact else math.nextafter(alpha, math.inf)


def compact_valid(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``values[valid]`` as float32 [N] (row-major); a free view when every token is valid."""
    values = values.detach().float()
    if bool(valid.all()):
        return values.reshape(-1)
    return values[valid]


def _order_keys(values: torch.Tensor, descending: bool) -> torch.Tensor:
    """int32 keys whose ascending order is the float32 order of ``values`` (or its reverse).

    IEEE-754 floats of one sign compare like their bit patterns; flipping the magnitude bits of
    negatives makes the whole range monotone. ``+ 0.0`` folds -0.0 into +0.0 so they tie.
    """
    bits = (values.detach().float() + 0.0).view(torch.int32)
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return ~keys if descending else keys  # ~k = -k - 1 reverses the order


def ascending_ranks(values: torch.Tensor, *, descending: bool = False) -> torch.Tensor:
    """Rank of each element, ties broken by index. [N] float -> [N] int32 (int64 past 2^31).

    ``ranks[i] < k`` iff element i is among the k smallest (largest if ``descending``).
    """
    order = torch.sort(_order_keys(values, descending), stable=True).indices  # [N]
    dtype = torch.int32 if order.numel() < 2**31 else torch.int64
    ranks = torch.empty(order.shape, dtype=dtype, device=order.device)
    return ranks.scatter_(0, order, torch.arange(order.numel(), dtype=dtype, device=order.device))


def smallest_k_mask(values: torch.Tensor, k: int) -> torch.Tensor:
    """Bool [N]: the k smallest values, ties by index (k clipped to [0, N])."""
    return ascending_ranks(values) < k


def largest_k_mask(values: torch.Tensor, k: int) -> torch.Tensor:
    """Bool [N]: the k largest values, ties by index (earlier first)."""
    return ascending_ranks(values, descending=True) < k


def _masked_sum(values: torch.Tensor, mask: torch.Tensor) -> float:
    """sum(values[mask]) without materialising the selection."""
    return float(torch.where(mask, values, torch.zeros((), dtype=values.dtype)).sum())


def _select(mask: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same boolean selection of several 1-D tensors (one nonzero scan, then gathers)."""
    idx = mask.nonzero()[:, 0]
    return tuple(t.index_select(0, idx) for t in tensors)


class IntersectionPath:
    """The family F(alpha) = Bottom_{k1}(low) ∩ E_{k2}(a) over N compact tokens.

    ``k_i(alpha) = floor(clip(alpha * p_i, 0, 1) * N)`` as in Algorithm 2's BuildFilter, and E is
    ``Top(|a|)`` (``extreme="abs"``) or ``Top(a) ∪ Bottom(a)`` (``"two_sided"``). Ranks are
    computed once; evaluating a set is one comparison per token and never re-sorts. Because
    rank sets are nested, ``weight`` summed over F(alpha) is non-decreasing in alpha, which makes
    the binary searches exact.

    Args:
        low: [N] values whose *smallest* are selected (the grounding gap).
        a: [N] signed divergences A_full (the extreme set).
        weight: [N] non-negative mass of each token (|A| / M for FLMR, 1 for counts).
        p1, p2: base ratios p_i^0 in [0, 1].
        extreme: "abs" or "two_sided".
    """

    def __init__(self, low: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, p1: float,
                 p2: float, *, extreme: str) -> None:
        self.p1, self.p2 = p1, p2
        self.n = low.numel()
        self.weight = weight
        self.r1 = ascending_ranks(low)
        if extreme == "abs":
            self.r2 = ascending_ranks(a.abs(), descending=True)
        else:  # in Top_k(a) or Bottom_k(a) iff the smaller of the two ranks is < k
            self.r2 = torch.minimum(ascending_ranks(a, descending=True), ascending_ranks(a))

    def ks(self, alpha: float) -> tuple[int, int]:
        return count_for(self.p1, self.n, alpha), count_for(self.p2, self.n, alpha)

    def mask(self, alpha: float) -> torch.Tensor:
        """Bool [N]: membership in F(alpha)."""
        k1, k2 = self.ks(alpha)
        return (self.r1 < k1) & (self.r2 < k2)

    def mass(self, alpha: float) -> float:
        """Sum of ``weight`` over F(alpha)."""
        return _masked_sum(self.weight, self.mask(alpha))

    def _search(self, lo: float, hi: float, ok: Callable[[float], bool]
                ) -> tuple[str, float, float]:
        """Bisect on alpha until no other (k1, k2) pair lies strictly between lo and hi.

        ``ok`` is a predicate on the mass that holds at small alpha and fails at large alpha.
        Returns ``("fails_at_lo", lo, lo)`` when ``ok`` already fails at lo,
        ``("holds_at_hi", hi, hi)`` when it still holds at hi, else ``("split", lo, hi)`` with
        ``ok`` holding at lo and failing at hi, at adjacent steps.

        Only midpoints that change the pair of counts are evaluated. Since F(lo) ⊆ F(mid) ⊆
        F(hi), only the tokens of F(hi) \\ F(lo) are undecided: they form a pool that loses the
        tokens decided at every evaluation (those of F(mid) when lo moves up, the others when hi
        moves down), so the whole search touches about 2N token entries and never sorts.
        """
        k_lo, k_hi = self.ks(lo), self.ks(hi)
        inside_lo = (self.r1 < k_lo[0]) & (self.r2 < k_lo[1])
        base = _masked_sum(self.weight, inside_lo)  # mass of F(lo)
        if not ok(base):
            return "fails_at_lo", lo, lo
        pool = (self.r1 < k_hi[0]) & (self.r2 < k_hi[1]) & ~inside_lo
        r1, r2, w = _select(pool, self.r1, self.r2, self.weight)
        if ok(base + float(w.sum())):
            return "holds_at_hi", hi, hi
        while True:
            mid = 0.5 * (lo + hi)
            if not lo < mid < hi:  # float resolution reached
                return "split", lo, hi
            k_mid = self.ks(mid)
            if k_mid == k_lo:
                lo = mid
            elif k_mid == k_hi:
                hi = mid
            else:
                sel = (r1 < k_mid[0]) & (r2 < k_mid[1])
                gained = _masked_sum(w, sel)
                if ok(base + gained):
                    lo, k_lo, base = mid, k_mid, base + gained
                    r1, r2, w = _select(~sel, r1, r2, w)
                else:
                    hi, k_hi = mid, k_mid
                    r1, r2, w = _select(sel, r1, r2, w)

    def largest_alpha_at_most(self, lo: float, hi: float, bound: float) -> float:
        """Largest alpha in [lo, hi] with mass(alpha) <= bound.

        The feasible set is an interval [lo, a*) (mass is a right-continuous step function), so
        the returned alpha is a* approached from below to float resolution; F(alpha) is the
        largest feasible set. Requires mass(lo) <= bound; returns hi if mass(hi) <= bound.
        """
        status, found, _ = self._search(lo, hi, lambda m: m <= bound)
        if status == "fails_at_lo":
            raise ValueError(f"mass at alpha={lo} already exceeds {bound}")
        return found

    def smallest_alpha_at_least(self, lo: float, hi: float, bound: float) -> float | None:
        """Smallest alpha in [lo, hi] with mass(alpha) >= bound, or None if even hi falls short.

        The returned alpha is the exact step where the mass first reaches ``bound``.
        """
        status, _, found = self._search(lo, hi, lambda m: m < bound)
        return None if status == "holds_at_hi" else found
