"""The float64 full-vocabulary reference of the top-k KL objectives and the logits it is checked
on: one implementation for ``tests/signals/test_topk_tails.py`` and
``experiments/benchmarks/topk_tails.py`` (issue 25's exact tails)."""

from __future__ import annotations

import math

import torch

from saopd.filters import FILTERS
from saopd.objectives import OBJECTIVES
from saopd.signals import Logits, TokenSignals, score_tokens

__all__ = ["B", "K", "T", "V", "exact_tail", "logits_with_tail", "reference_kl", "run_topk_kl",
           "topk_signals"]

V, K, B, T = 1000, 16, 2, 3


def logits_with_tail(tail: float, student: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[B, T, V]`` (student, teacher) logits; the teacher's K largest hold all but
    ``tail`` of its mass (set in float64). ``diffuse``: a student of Gaussian logits (tail
    ~0.98); ``close``: the teacher's logits plus unit noise (a tail as small as the teacher's)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randn(B, T, K, generator=g, dtype=torch.float64)
    rest = torch.randn(B, T, V - K, generator=g, dtype=torch.float64)
    shift = rest.logsumexp(-1) + math.log1p(-tail) - math.log(tail) - head.logsumexp(-1)
    ordered = torch.cat([head + shift[..., None], rest], dim=-1)
    perm = torch.rand(B, T, V, generator=g).argsort(-1)
    teacher = torch.empty_like(ordered).scatter_(-1, perm, ordered)
    noise = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    student_logits = 2 * noise if student == "diffuse" else teacher + noise
    return student_logits.float(), teacher.float()


def exact_tail(logp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return logp.scatter(-1, ids, float("-inf")).logsumexp(-1)


def reference_kl(z_s: torch.Tensor, z_t: torch.Tensor, ids: torch.Tensor, direction: str,
               tail: str, teacher_tail: torch.Tensor | None = None) -> torch.Tensor:
    """The KL written from its definition in float64 over the whole vocabulary (``z_s`` may
    require grad): lumped = the (K + 1)-bucket KL with exact tails (``teacher_tail`` replaces
    the teacher's); none = verl's sum over the ids; renormalize = NeMo-RL's KL of the lists
    renormalised (log_softmax over the K values)."""
    lp, lq = torch.log_softmax(z_s.double(), -1), torch.log_softmax(z_t.double(), -1)
    a_s, a_t = lp.gather(-1, ids), lq.gather(-1, ids)
    if tail == "renormalize":
        a_s, a_t = a_s.log_softmax(-1), a_t.log_softmax(-1)
    x, y = (a_t, a_s) if direction == "forward" else (a_s, a_t)
    out = (x.exp() * (x - y)).sum(-1)
    if tail == "lumped":
        t_s = exact_tail(lp, ids)
        t_t = exact_tail(lq, ids) if teacher_tail is None else teacher_tail
        tx, ty = (t_t, t_s) if direction == "forward" else (t_s, t_t)
        out = out + tx.exp() * (tx - ty)
    return out


def topk_signals(z: torch.Tensor, z_t: torch.Tensor, *, lists_only: bool = False) -> TokenSignals:
    """The signals ``score_student`` builds, from the chunked scoring of ``Logits``."""
    sc = score_tokens(Logits(z), torch.zeros(B, T, dtype=torch.long), teacher=Logits(z_t),
                      teacher_top_k=K, chunk_size=4)
    return TokenSignals(
        lp_student=sc.logprobs, lp_teacher=sc.teacher_logprobs,
        valid=torch.ones(B, T, dtype=torch.bool), teacher_topk_ids=sc.teacher_topk_ids,
        teacher_topk_lp_teacher=sc.teacher_topk_logprobs,
        teacher_topk_lp_student=sc.logprobs_at_ids,
        teacher_topk_tail_teacher=None if lists_only else sc.teacher_topk_tail,
        teacher_topk_tail_student=sc.tail_at_ids)


def run_topk_kl(z_s: torch.Tensor, z_t: torch.Tensor, top_k: int = K, lists_only: bool = False,
         **objective: str):
    z = z_s.clone().requires_grad_(True)
    signals = topk_signals(z, z_t, lists_only=lists_only)
    out = OBJECTIVES.build("topk_kl", top_k=top_k, **objective)(
        signals, FILTERS.build("none")(signals))
    out.loss.sum().backward()
    return out, z.grad, signals
