"""Which residual scores SA-OPD's selection really needs, and when skipping some is exact.

SA-OPD's filtered set (paper Eq. 16, fixed ratios) is

    F = Bottom_{k1}(Delta) ∩ E_{k2}(A_full),   k_i = floor(p_i * N),

with both selections rank-based over all N valid tokens of the batch (ties by row-major index,
:mod:`saopd.filters.ranks`). The candidates C = E_{k2}(A_full) (``Top_p2(|A_full|)`` or the
two-sided set) come from the full-context pass alone, so F ⊆ C. The grounding gap
Delta = |A_full - A_res| needs the residual pass, and a causal model scores a row's position only
by running its whole prefix: skipping is possible only for whole rows without a candidate and for
the tail of a row after its last candidate (:func:`residual_stops`).

But Bottom_{k1}(Delta) ranks *every* valid token: a skipped token's Delta can push a candidate
past the k1 cut. So skipping is exact only with a certificate. Let S be the scored tokens,
U = V \\ S, u = |U|, and for a candidate c let r_S(c) be its rank among S. Whatever Delta is on U,
c's rank over V lies in [r_S(c), r_S(c) + u]; so if every candidate has r_S(c) >= k1 (out of F
for any Delta on U) or r_S(c) + u < k1 (in F for any Delta on U), F is the same for every value
the skipped tokens could have had (:func:`certify_selection`). Otherwise the skipped tokens must
be scored. Under Algorithm 2's FLMR bound the selection depends on a search over alpha (each
alpha has its own k1), so no such certificate is offered there.

What this buys (measured in ``experiments/benchmarks/residual_savings.py``, ``docs/benchmarks.md``):
at the paper's p2 = 0.3 nearly every row has a candidate within a few tokens of its end, so the
skippable share is about (1 - p2) / p2 / R per row, about 0.5% at R = 512, and the certificate
then usually fails anyway (about u * p2 candidates sit within u ranks of the cut). This module is
therefore an analysis tool, not wired into the training step.
"""

from __future__ import annotations

import torch

from saopd.choices import EXTREMES
from saopd.filters.ranks import ascending_ranks, compact_valid, count_for
from saopd.validation import check_choice, check_fraction, check_same_shape

__all__ = ["candidate_mask", "certify_selection", "residual_stops"]


def _check_valid(valid: torch.Tensor) -> None:
    if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or valid.dim() != 2:
        raise ValueError("valid must be a bool tensor [B, R]")


def candidate_mask(a_full: torch.Tensor, valid: torch.Tensor, p2: float, *,
                   extreme: str = "abs") -> torch.Tensor:
    """C = E_{k2}(A_full), k2 = floor(p2 * N): bool [B, R], the only tokens F can contain.

    Args:
        a_full: float [B, R], A_full = lpS - lpT (Eq. 12).
        valid: bool [B, R], True = a response token (the set V).
        p2: the extreme share of Eq. 16 (for Algorithm 2 with alpha <= 1, its base p2^0).
        extreme: ``"abs"`` (Top_p2(|A|)) or ``"two_sided"`` (Top_p2(A) ∪ Bottom_p2(A)).
    """
    _check_valid(valid)
    check_same_shape("a_full", a_full, valid.shape, "valid")
    check_fraction("p2", p2)
    check_choice("extreme", extreme, EXTREMES)
    a = compact_valid(a_full, valid)  # [N]
    k2 = count_for(p2, a.numel())
    if extreme == "abs":
        rank = ascending_ranks(a.abs(), descending=True)
    else:
        rank = torch.minimum(ascending_ranks(a, descending=True), ascending_ranks(a))
    out = torch.zeros_like(valid)
    return out.masked_scatter_(valid, rank < k2)


def residual_stops(candidates: torch.Tensor) -> torch.Tensor:
    """Per row, the number of leading response slots a residual pass must score: the last
    candidate's slot + 1 (0 = the row has no candidate). Long [B]."""
    if candidates.dtype != torch.bool or candidates.dim() != 2:
        raise ValueError("candidates must be a bool tensor [B, R]")
    r = candidates.shape[1]
    slots = torch.arange(1, r + 1, device=candidates.device)
    return torch.where(candidates, slots, torch.zeros_like(slots)).amax(dim=1)


def certify_selection(delta: torch.Tensor, scored: torch.Tensor, candidates: torch.Tensor,
                      valid: torch.Tensor, p1: float) -> tuple[bool, int]:
    """Whether Bottom_{k1}(Delta) ∩ C is the same for every value of Delta off ``scored``.

    Args:
        delta: float [B, R], the grounding gap; read only where ``scored``.
        scored: bool [B, R], tokens whose residual scores exist (a subset of ``valid`` that
            contains every candidate).
        candidates: bool [B, R], C from :func:`candidate_mask`.
        valid: bool [B, R], V.
        p1: the Bottom share of Eq. 16 (k1 = floor(p1 * |V|)).

    Returns:
        ``(certified, undecided)``: whether every candidate is decided, and how many are not.
        When certified, SA-OPD's fixed-ratio F computed with *any* values at the unscored valid
        tokens equals the F of the true values.
    """
    _check_valid(valid)
    for name, t in (("scored", scored), ("candidates", candidates)):
        if t.dtype != torch.bool:
            raise ValueError(f"{name} must be a bool tensor [B, R]")
        check_same_shape(name, t, valid.shape, "valid")
    check_same_shape("delta", delta, valid.shape, "valid")
    check_fraction("p1", p1)
    if bool((scored & ~valid).any()) or bool((candidates & ~scored).any()):
        raise ValueError("scored must be a subset of valid and contain every candidate")
    n = int(valid.sum())
    k1 = count_for(p1, n)
    u = n - int(scored.sum())
    d = compact_valid(delta, scored)  # [|S|], row-major: the same tie order as over V
    rank_s = ascending_ranks(d)  # rank among S
    is_cand = candidates[scored]  # [|S|]
    r = rank_s[is_cand].long()
    undecided = int(((r < k1) & (r + u >= k1)).sum())
    return undecided == 0, undecided
