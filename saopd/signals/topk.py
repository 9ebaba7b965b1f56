"""Divergences between two distributions known only on K candidate ids.

A top-K list gives, at one position, K token ids and two models' log-probs at them (say
``lp_p`` and ``lp_q``, ``[..., K]``). What happens to the rest of the vocabulary is a choice:

- **lumped** (:func:`bucket_kl`): the rest is one bucket, the *tail*, with probability
  ``P_tail = 1 - sum_k exp(lp_p[k])`` (``Q_tail`` likewise), and the divergence is the exact KL
  between these two (K + 1)-bucket distributions:

      KL_K(P || Q) = sum_k p_k (log p_k - log q_k) + P_tail (log P_tail - log Q_tail)

  It is >= 0, 0 iff the two agree on the K ids (and hence on the tail), and never larger than
  the full-vocabulary KL(P || Q) (lumping is a coarse-graining: the data-processing inequality).
  With K = V the tail is empty and KL_K is the full KL. [ours]
- **none** (:func:`truncated_kl`): ``sum_k p_k (log p_k - log q_k)``, the rest ignored: verl's
  ``compute_forward_kl_topk`` with P the teacher. Not a divergence (it can be negative).
- **renormalize** (:func:`renormalized_kl`): the KL between p and q each renormalised over the
  K ids, ``p~ = softmax(lp_p)``: NeMo-RL's distillation loss with its default
  ``zero_outside_topk: false``. Mass the student puts outside the K ids is not penalised.

The tail's log-mass
-------------------
Computed from the list alone, ``log(1 - sum_k p_k)`` cannot resolve a small tail: the listed
log-probs are float32 values (from float32 log-softmaxes of logits of magnitude ~10-100), each
off by ~1e-7..1e-6 in relative mass, so a tail below ~1e-6 is indistinguishable from 0. The
list-only tail (:func:`tail_log_mass`) is therefore computed in float64 with the listed mass
capped at ``exp(LISTED_LOG_MASS_CAP)`` = 1 - 1e-6: a tail at or below 1e-6 becomes exactly
``log1mexp(1e-6)`` ~ -13.8 (the floor; zero gradient there), never the -100 of
``LOGPROB_FLOOR``, which would turn ``P_tail (log P_tail - log Q_tail)`` into ``P_tail (log
P_tail + 100)``. Where the logits are at hand, the exact tail (a logsumexp over the unlisted
logits, ``saopd.signals.logprobs``: ``tail_at_ids``, ``teacher_topk_tail``) is given to
:func:`bucket_kl` instead (``tail_from`` / ``tail_to``) and no floor applies.

The lists themselves come from the chunked scoring (:func:`saopd.signals.logprobs.score_tokens`),
which takes them from each ``[C, V]`` block of float32 log-probs with :func:`block_top_k` (the K
largest, ordered by (-log-prob, id): ties at the boundary go to the smaller ids) and
:func:`block_tail` (the exact log-mass outside given ids).

Numerics: log-probs are expected already clamped at ``LOGPROB_FLOOR`` (as :class:`TokenSignals`
stores them). Sums run in float64; results are float32; gradients flow into every log-prob and
tail argument through ordinary autograd (the K-sized tensors are small); the two block functions
run inside the chunked scoring's forward, whose backward is its own. Nothing here returns NaN for
finite inputs.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "LISTED_LOG_MASS_CAP",
    "LIST_TAIL_FLOOR",
    "block_tail",
    "block_top_k",
    "bucket_kl",
    "prefix_tail",
    "renormalized_kl",
    "tail_floored",
    "tail_log_mass",
    "truncated_kl",
    "union_mask",
]

LISTED_LOG_MASS_CAP: float = -1e-6
"""The largest log listed mass a list alone is trusted with (mass 1 - 1e-6): the list-only tail
is at least ``log(-expm1(-1e-6))`` ~ -13.8, i.e. a tail mass of 1e-6 (module docstring)."""
LIST_TAIL_FLOOR: float = math.log(-math.expm1(LISTED_LOG_MASS_CAP))
"""The list-only tail's floor, ``log(-expm1(LISTED_LOG_MASS_CAP))`` ~ -13.8155 nats."""


def _listed_log_mass(logprobs: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """float64 ``[...]``: log sum_k exp(logprobs[..., k]) over the unmasked columns."""
    lp = logprobs.double()
    if mask is not None:
        lp = lp.masked_fill(~mask, float("-inf"))
    return torch.logsumexp(lp, dim=-1)


def tail_log_mass(logprobs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """log(1 - sum_k exp(logprobs[..., k])) from the list alone: the log-probability of every id
    not listed, floored where the list cannot resolve it (module docstring).

    Args:
        logprobs: float ``[..., K]`` log-probs of K distinct ids under one distribution.
        mask: optional bool ``[..., K]``; False entries are left out of the sum (ids listed
            twice, see :func:`union_mask`).

    Returns:
        float64 ``[...]``, at least ``log(-expm1(LISTED_LOG_MASS_CAP))`` ~ -13.8; where the
        listed mass reaches 1 - 1e-6 (or 1, or above by rounding) the value is that floor with
        zero gradient (:func:`tail_floored` says where).
    """
    listed = _listed_log_mass(logprobs, mask).clamp(max=LISTED_LOG_MASS_CAP)
    return torch.log(-torch.expm1(listed))


def tail_floored(logprobs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """bool ``[...]``: where :func:`tail_log_mass` returns its floor (the list's tail is at or
    below the mass 1e-6 it can resolve)."""
    return _listed_log_mass(logprobs, mask) >= LISTED_LOG_MASS_CAP


def prefix_tail(logprobs: torch.Tensor, tail: torch.Tensor, k: int) -> torch.Tensor:
    """The exact log tail of the first ``k`` columns of a list, from the exact log tail
    ``tail`` ``[...]`` of all K columns: logsumexp of ``tail`` and ``logprobs[..., k:]``.

    Returns float64 ``[...]`` (``tail`` itself, upcast, when ``k`` >= K); differentiable w.r.t.
    both arguments."""
    rest = logprobs[..., k:].double()
    if rest.shape[-1] == 0:
        return tail.double()
    return torch.logsumexp(torch.cat([tail.double()[..., None], rest], dim=-1), dim=-1)


def _check_pair(lp_from: torch.Tensor, lp_to: torch.Tensor) -> None:
    if lp_from.shape != lp_to.shape:
        raise ValueError(f"lp_from has shape {tuple(lp_from.shape)} but lp_to has "
                         f"{tuple(lp_to.shape)}")


def _listed_terms(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """float64 ``[...]``: sum over the unmasked columns of exp(a) (a - b)."""
    terms = a.exp() * (a - b)
    if mask is not None:
        terms = torch.where(mask, terms, torch.zeros((), dtype=terms.dtype, device=terms.device))
    return terms.sum(dim=-1)


def bucket_kl(lp_from: torch.Tensor, lp_to: torch.Tensor, mask: torch.Tensor | None = None, *,
              tail_from: torch.Tensor | None = None, tail_to: torch.Tensor | None = None
              ) -> torch.Tensor:
    """KL_K(P || Q) over K listed ids plus the lumped tail (the module docstring's formula).

    Args:
        lp_from: float ``[..., K]``, log P at the listed ids (the KL's first argument).
        lp_to: float ``[..., K]``, log Q at the same ids, in the same column order.
        mask: optional bool ``[..., K]``; False entries are not listed (they belong to neither
            the sum nor the masses; used to drop ids listed twice, see :func:`union_mask`).
        tail_from, tail_to: optional float ``[...]``, the exact log-mass of P / Q outside the
            listed ids (computed over the whole vocabulary); a side without one takes the
            list-only :func:`tail_log_mass` (floored at a tail mass of 1e-6).

    Returns:
        float32 ``[...]``, differentiable w.r.t. every tensor argument. Entries with P = 0
        contribute 0; inputs must be finite (clamp log-probs at ``LOGPROB_FLOOR`` first). With
        both tails exact (or resolvable) the value is >= 0 up to rounding; a floored tail can
        make it slightly negative (by about the floor's 1e-6 mass).
    """
    _check_pair(lp_from, lp_to)
    a, b = lp_from.double(), lp_to.double()
    t_a = tail_log_mass(a, mask) if tail_from is None else tail_from.double()
    t_b = tail_log_mass(b, mask) if tail_to is None else tail_to.double()
    return (_listed_terms(a, b, mask) + t_a.exp() * (t_a - t_b)).float()


def truncated_kl(lp_from: torch.Tensor, lp_to: torch.Tensor) -> torch.Tensor:
    """``sum_k p_k (log p_k - log q_k)`` over the K listed ids, nothing for the rest (verl's
    top-k forward KL with P the teacher). float ``[..., K]`` each -> float32 ``[...]``,
    differentiable w.r.t. both; can be negative."""
    _check_pair(lp_from, lp_to)
    return _listed_terms(lp_from.double(), lp_to.double(), None).float()


def renormalized_kl(lp_from: torch.Tensor, lp_to: torch.Tensor) -> torch.Tensor:
    """KL(P~ || Q~) with P~ = softmax(lp_from), Q~ = softmax(lp_to) over the K listed ids
    (NeMo-RL's default). float ``[..., K]`` each -> float32 ``[...]`` >= 0, differentiable
    w.r.t. both."""
    _check_pair(lp_from, lp_to)
    a = torch.log_softmax(lp_from.double(), dim=-1)
    b = torch.log_softmax(lp_to.double(), dim=-1)
    return _listed_terms(a, b, None).float()


def union_mask(first_ids: torch.Tensor, second_ids: torch.Tensor) -> torch.Tensor:
    """bool ``[..., K1 + K2]``: which columns of ``cat([first_ids, second_ids], -1)`` list an id
    for the first time. Columns of ``first_ids`` are always True; a column of ``second_ids``
    is False when its id is already in ``first_ids`` (the two lists of one position must each
    hold distinct ids). With it, :func:`bucket_kl` over the concatenated log-probs is the KL
    over the union of the two top-K sets plus the tail."""
    again = (second_ids[..., :, None] == first_ids[..., None, :]).any(dim=-1)  # [..., K2]
    return torch.cat([torch.ones_like(first_ids, dtype=torch.bool), ~again], dim=-1)


# ---------------------------------------------------------------------------------------------
# Top-K lists of a full [C, V] block of log-probs (the chunked scoring's lists and tails)
# ---------------------------------------------------------------------------------------------

_TIE_GROUPS = 8  # the tie resolution of block_top_k works on at most 1/8 of a block's rows at once


def block_top_k(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row of a ``[C, V]`` block, ordered by (-value, id).

    Returns int64 ids and their values, both ``[C, k]`` (``1 <= k <= V``). ``torch.topk`` picks
    the candidates; in rows where more entries than fit tie with the k-th value, the tied
    entries with the smallest ids are taken instead (a rank among the tied entries from an int32
    cumulative count, on copies of those rows, at most 1/8 of the chunk at a time); a final
    stable sort of the k survivors
    orders them by value, ties by id. NaN entries are not supported.
    """
    values, ids = torch.topk(logp, k, dim=-1, largest=True, sorted=True)
    kth = values[:, -1:]  # [C, 1]
    tied = (logp >= kth).sum(dim=-1) > k  # [C]: a tie straddles the boundary
    if bool(tied.any()):
        all_rows = tied.nonzero().squeeze(-1)
        # groups of at most 1/8 of the chunk: the copies below stay a fraction of one block
        group = max(1, logp.shape[0] // _TIE_GROUPS)
        for rows in all_rows.split(group):
            sub, thr = logp[rows], kth[rows]  # [R, V], [R, 1]
            above = sub > thr
            equal = sub == thr
            room = k - above.sum(dim=-1, keepdim=True)  # tied entries that fit, per row
            take = above | (equal & (equal.cumsum(dim=-1, dtype=torch.int32) <= room))
            del above, equal
            chosen = take.nonzero()[:, 1].view(-1, k)  # row-major: ascending ids per row
            del take
            ids[rows] = chosen
            values[rows] = sub.gather(-1, chosen)
            del sub
    ids, perm = ids.sort(dim=-1)  # by id, then stably by value: (-value, id) order
    values = values.gather(-1, perm)
    values, perm = values.sort(dim=-1, descending=True, stable=True)
    return ids.gather(-1, perm), values


def block_tail(logp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log sum_{v not in ids} exp(logp_v) per row of a ``[C, V]`` log-prob block (``ids``
    ``[C, K]``): a logsumexp over a copy with the listed entries at ``-inf`` (float32); ``-inf``
    where nothing of nonzero probability is left."""
    return logp.scatter(-1, ids, float("-inf")).logsumexp(dim=-1)
