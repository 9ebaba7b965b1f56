"""Random top-K groups for :class:`TokenSignals` in tests (both groups, from real distributions)."""

from __future__ import annotations

import dataclasses

import torch

from saopd.signals import TokenSignals

TOPK_VOCAB, TOPK_K = 64, 32  # K covers every registered default (topk_kl: 32)


def with_topk(s: TokenSignals, *, seed: int = 0, dtype: torch.dtype = torch.float32,
              student_grad: bool = False) -> TokenSignals:
    """``s`` plus both top-K groups, drawn from distributions over a vocabulary of 64 (softmax of
    Gaussian logits), K = 32 distinct ids per position. ``student_grad``: the student's
    log-probs at the teacher's top-K are a leaf requiring grad, kept as ``.topk_leaf``; an
    existing ``.student_leaf`` of ``s`` is carried over (and given as ``lp_student``)."""
    batch, length = s.valid.shape
    g = torch.Generator().manual_seed(seed + 7)
    logq = torch.log_softmax(2 * torch.randn(batch, length, TOPK_VOCAB, generator=g), -1)
    logp = torch.log_softmax(2 * torch.randn(batch, length, TOPK_VOCAB, generator=g), -1)
    t_ids = logq.topk(TOPK_K, dim=-1).indices
    s_ids = logp.topk(TOPK_K, dim=-1).indices
    t_lp_s = logp.gather(-1, t_ids).to(dtype)
    if student_grad:
        t_lp_s.requires_grad_(True)
    values = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}
    leaf = getattr(s, "student_leaf", None)
    if leaf is not None:
        values["lp_student"] = leaf
    values.update(
        teacher_topk_ids=t_ids, teacher_topk_lp_teacher=logq.gather(-1, t_ids).to(dtype),
        teacher_topk_lp_student=t_lp_s, student_topk_ids=s_ids,
        student_topk_lp_student=logp.gather(-1, s_ids).to(dtype),
        student_topk_lp_teacher=logq.gather(-1, s_ids).to(dtype))
    out = TokenSignals(**values)
    out.student_leaf = leaf  # type: ignore[attr-defined]
    out.topk_leaf = t_lp_s  # type: ignore[attr-defined]
    return out
