"""Divergences between two distributions known only on K candidate ids, the rest lumped.

A top-K list gives, at one position, K token ids and two models' log-probs at them (say
``lp_p`` and ``lp_q``, ``[..., K]``). The remaining vocabulary is treated as one bucket, the
*tail*, with probability ``P_tail = 1 - sum_k exp(lp_p[k])`` (and ``Q_tail`` likewise). The
divergences here are exact KLs between these two (K + 1)-bucket distributions:

    KL_K(P || Q) = sum_k p_k (log p_k - log q_k) + P_tail (log P_tail - log Q_tail)

It is >= 0, 0 iff the two agree on the K ids (and hence on the tail), and never larger than the
full-vocabulary KL(P || Q) (lumping is a coarse-graining: the data-processing inequality). With
K = V the tail is empty and KL_K is the full KL. This is the "tail lumped" choice of the top-k KL
objectives (``saopd.objectives.topk_kl``) and of the top-k forward KL of Entropy-Aware OPD and
Token Teachability (``BASELINES.md``); the other common choice, renormalising p and q over the K
ids, drops the mass the student puts outside the teacher's top-K from the loss altogether.

Numerics: log-probs are expected already clamped at ``LOGPROB_FLOOR`` (as :class:`TokenSignals`
stores them). The tail's log-mass is computed in float64 as log(-expm1(logsumexp(lp))) and
clamped from below at ``LOGPROB_FLOOR`` too, so a tail that vanishes (K = V, or the K ids carry
all the mass up to rounding) gives a finite value with zero gradient, never NaN. Results are
float32; gradients flow into both arguments through ordinary autograd (the K-sized tensors are
small; only the chunked scoring ever touches ``[., V]``).
"""

from __future__ import annotations

import torch

from saopd.signals.token_signals import LOGPROB_FLOOR

__all__ = ["bucket_kl", "tail_log_mass", "union_mask"]


def tail_log_mass(logprobs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """log(1 - sum_k exp(logprobs[..., k])): the log-probability of every id not listed.

    Args:
        logprobs: float ``[..., K]`` log-probs of K distinct ids under one distribution.
        mask: optional bool ``[..., K]``; False entries are left out of the sum (ids listed
            twice, see :func:`union_mask`).

    Returns:
        float64 ``[...]``, clamped at ``LOGPROB_FLOOR`` (a tail of mass below e^-100, or a sum
        that reaches 1 by rounding, gives ``LOGPROB_FLOOR`` with zero gradient).
    """
    lp = logprobs.double()
    if mask is not None:
        lp = lp.masked_fill(~mask, float("-inf"))
    listed = torch.logsumexp(lp, dim=-1)  # log of the listed mass, <= 0 up to rounding
    # log(1 - e^x) = log(-expm1(x)); the double where keeps x = 0 (or > 0) out of the log, so
    # neither the value nor the gradient ever sees log(0) = -inf
    room = listed < 0
    safe = torch.where(room, listed, torch.full_like(listed, -1.0))
    tail = torch.log(-torch.expm1(safe))
    return torch.where(room, tail, torch.full_like(tail, LOGPROB_FLOOR)).clamp(min=LOGPROB_FLOOR)


def bucket_kl(lp_from: torch.Tensor, lp_to: torch.Tensor,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """KL_K(P || Q) over K listed ids plus the lumped tail (the module docstring's formula).

    Args:
        lp_from: float ``[..., K]``, log P at the listed ids (the KL's first argument).
        lp_to: float ``[..., K]``, log Q at the same ids, in the same column order.
        mask: optional bool ``[..., K]``; False entries are not listed (they belong to neither
            the sum nor the masses; used to drop ids listed twice, see :func:`union_mask`).

    Returns:
        float32 ``[...]``, differentiable w.r.t. both log-prob tensors. Entries with P = 0
        contribute 0; inputs must be finite (clamp log-probs at ``LOGPROB_FLOOR`` first).
    """
    if lp_from.shape != lp_to.shape:
        raise ValueError(f"lp_from has shape {tuple(lp_from.shape)} but lp_to has "
                         f"{tuple(lp_to.shape)}")
    a, b = lp_from.double(), lp_to.double()
    terms = a.exp() * (a - b)
    if mask is not None:
        terms = torch.where(mask, terms, torch.zeros((), dtype=terms.dtype, device=terms.device))
    tail_a, tail_b = tail_log_mass(a, mask), tail_log_mass(b, mask)
    return (terms.sum(dim=-1) + tail_a.exp() * (tail_a - tail_b)).float()


def union_mask(first_ids: torch.Tensor, second_ids: torch.Tensor) -> torch.Tensor:
    """bool ``[..., K1 + K2]``: which columns of ``cat([first_ids, second_ids], -1)`` list an id
    for the first time. Columns of ``first_ids`` are always True; a column of ``second_ids``
    is False when its id is already in ``first_ids`` (the two lists of one position must each
    hold distinct ids). With it, :func:`bucket_kl` over the concatenated log-probs is the KL
    over the union of the two top-K sets plus the tail."""
    again = (second_ids[..., :, None] == first_ids[..., None, :]).any(dim=-1)  # [..., K2]
    return torch.cat([torch.ones_like(first_ids, dtype=torch.bool), ~again], dim=-1)
