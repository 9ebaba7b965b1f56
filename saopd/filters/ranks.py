"""Rank-based Bottom_p / Top_p selection over the valid tokens of a batch, and the alpha search.

``BASELINES.md`` fixes the meaning of the paper's top-p selections (Eq. 16): ``Bottom_p(x)`` is
the floor(p * N) valid tokens with the smallest x, ``Top_p(x)`` the floor(p * N) with the largest,
ties broken by position (the earlier token of the row-major flattened batch wins). Working with
ranks instead of thresholds makes every selection exact and nested: Bottom_p is a subset of
Bottom_q for p <= q, so anything summed over an intersection of such sets is monotone in p.

All functions here work on *compact* 1-D tensors holding only the N valid tokens, in row-major
order of the ``[B, T]`` batch (``x[valid]``), so padding never changes a rank.

Speed: a k-selection is found in O(N) with ``kthvalue`` (no sort); ranks are needed only for the
k tokens that can ever be selected, and those are sorted once, on int64 keys that pack the value's
order-preserving bits with the token index (unique keys: ties are broken by index whatever the
sort algorithm).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def count_for(p: float, n: int) -> int:
    """Size of a rank-based p-selection over n tokens: floor(clip(p, 0, 1) * n)."""
    return math.floor(min(max(p, 0.0), 1.0) * n)


def _ascending_view(values: torch.Tensor, descending: bool) -> torch.Tensor:
    """float32 values whose ascending order is the wanted order (-0.0 folded into +0.0)."""
    x = values.detach().float()
    return (-x if descending else x) + 0.0


def smallest_k_mask(values: torch.Tensor, k: int, *, descending: bool = False) -> torch.Tensor:
    """Bool [N]: the k smallest values (largest if ``descending``), ties by index. O(N).

    ``k`` is clipped to [0, N].
    """
    x = _ascending_view(values, descending)
    n = x.numel()
    k = min(max(k, 0), n)
    if k == 0:
        return torch.zeros(n, dtype=torch.bool, device=x.device)
    if k == n:
        return torch.ones(n, dtype=torch.bool, device=x.device)
    kth = torch.kthvalue(x, k).values
    below = x < kth
    ties = x == kth
    need = k - int(below.sum())
    if int(ties.sum()) > need:  # take the earliest tied tokens
        ties &= torch.cumsum(ties, 0) <= need
    return below | ties


def largest_k_mask(values: torch.Tensor, k: int) -> torch.Tensor:
    """Bool [N]: the k largest values, ties by index (earlier first). O(N)."""
    return smallest_k_mask(values, k, descending=True)


def partial_ranks(values: torch.Tensor, k: int, *, descending: bool = False) -> torch.Tensor:
    """Ranks of the k smallest (largest) values; every other token gets the sentinel N.

    [N] float -> [N] int64. ``ranks[i] < j`` iff token i is among the j smallest, for any
    j <= k. Ties are broken by index. Only the k selected tokens are sorted.
    """
    x = _ascending_view(values, descending)
    n = x.numel()
    k = min(max(k, 0), n)
    ranks = torch.full((n,), n, dtype=torch.int64, device=x.device)
    if k == 0:
        return ranks
    idx = torch.arange(n, device=x.device) if k == n else smallest_k_mask(x, k).nonzero()[:, 0]
    bits = x[idx].view(torch.int32).to(torch.int64)
    # order-preserving map of float32 bits to [0, 2^32): flip negatives, offset positives
    key = torch.where(bits < 0, -bits - 1, bits + (1 << 31))
    packed = (key << max(1, (n - 1).bit_length())) | idx  # unique, value-major, index-minor
    order = torch.sort(packed).indices
    ranks.scatter_(0, idx[order], torch.arange(k, device=x.device))
    return ranks


class IntersectionPath:
    """The family F(alpha) = Bottom_{k1}(low) ∩ E_{k2}(a) over N compact tokens.

    ``k_i(alpha) = floor(clip(alpha * p_i, 0, 1) * N)`` as in Algorithm 2's BuildFilter, and E is
    ``Top(|a|)`` (``extreme="abs"``) or ``Top(a) ∪ Bottom(a)`` (``"two_sided"``). Ranks are
    computed once, for alpha up to ``max_alpha``; evaluating a set is one comparison per token
    and never re-sorts. Because rank sets are nested, ``weight`` summed over F(alpha) is
    non-decreasing in alpha, which makes the binary searches exact.

    Args:
        low: [N] values whose *smallest* are selected (the grounding gap).
        a: [N] signed divergences A_full (the extreme set).
        weight: [N] non-negative mass of each token (|A| / M for FLMR, 1 for counts).
        p1, p2: base ratios p_i^0 in [0, 1].
        extreme: "abs" or "two_sided".
        max_alpha: largest alpha the path will be asked about.
    """

    def __init__(self, low: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, p1: float,
                 p2: float, *, extreme: str, max_alpha: float) -> None:
        self.p1, self.p2 = p1, p2
        self.n = low.numel()
        self.weight = weight
        self.max_alpha = max_alpha
        k1, k2 = self.ks(max_alpha)
        self.r1 = partial_ranks(low, k1)
        if extreme == "abs":
            self.r2 = partial_ranks(a.abs(), k2, descending=True)
        else:
            self.r2 = torch.minimum(partial_ranks(a, k2, descending=True), partial_ranks(a, k2))

    def ks(self, alpha: float) -> tuple[int, int]:
        return count_for(alpha * self.p1, self.n), count_for(alpha * self.p2, self.n)

    def mask(self, alpha: float) -> torch.Tensor:
        """Bool [N]: membership in F(alpha)."""
        if alpha > self.max_alpha:
            raise ValueError(f"alpha={alpha} is beyond this path's max_alpha={self.max_alpha}")
        k1, k2 = self.ks(alpha)
        return (self.r1 < k1) & (self.r2 < k2)

    def mass(self, alpha: float) -> float:
        """Sum of ``weight`` over F(alpha)."""
        return float(self.weight[self.mask(alpha)].sum())

    def _search(self, lo: float, hi: float, ok: Callable[[float], bool]) -> tuple[float, float]:
        """Bisect on alpha until no other (k1, k2) pair lies strictly between lo and hi.

        Invariant: ``ok(mass(lo))`` is True and ``ok(mass(hi))`` is False. Only midpoints that
        change the pair of counts are evaluated; each evaluation is a masked sum over the tokens
        of F(hi), a pool that shrinks whenever hi moves down, so the whole search costs about
        log2(N) passes over ever smaller subsets and never sorts. Returns the final (lo, hi).
        """
        pool = self.mask(hi)
        r1, r2, w = self.r1[pool], self.r2[pool], self.weight[pool]
        ks_lo, ks_hi = self.ks(lo), self.ks(hi)
        while True:
            mid = 0.5 * (lo + hi)
            if not lo < mid < hi:  # float resolution reached
                return lo, hi
            ks_mid = self.ks(mid)
            if ks_mid == ks_lo:
                lo = mid
            elif ks_mid == ks_hi:
                hi = mid
            else:
                sel = (r1 < ks_mid[0]) & (r2 < ks_mid[1])
                if ok(float(w[sel].sum())):
                    lo, ks_lo = mid, ks_mid
                else:
                    hi, ks_hi = mid, ks_mid
                    r1, r2, w = r1[sel], r2[sel], w[sel]

    def largest_alpha_at_most(self, lo: float, hi: float, bound: float) -> float:
        """Largest alpha in [lo, hi] with mass(alpha) <= bound.

        The feasible set is an interval [lo, a*) (mass is a right-continuous step function), so
        the returned alpha is a* approached from below to float resolution; F(alpha) is the
        largest feasible set. Requires mass(lo) <= bound; returns hi if mass(hi) <= bound.
        """
        if self.mass(hi) <= bound:
            return hi
        return self._search(lo, hi, lambda m: m <= bound)[0]

    def smallest_alpha_at_least(self, lo: float, hi: float, bound: float) -> float | None:
        """Smallest alpha in [lo, hi] with mass(alpha) >= bound, or None if even hi falls short.

        The returned alpha is the exact step where the mass first reaches ``bound``.
        """
        if self.mass(hi) < bound:
            return None
        if self.mass(lo) >= bound:
            return lo
        return self._search(lo, hi, lambda m: m < bound)[1]
