"""Chunked per-token scoring of a language model's next-token distribution.

For every position t of a batch of sequences this module computes, from the model's logits z_t
over a vocabulary of V tokens (softmax at ``temperature`` tau):

- ``lpS = log pi_S(y_t | x, y_<t)`` = log softmax(z_t / tau)[y_t], the log-probability of the
  target (sampled) token y_t;
- ``H_S = -sum_v pi_S(v) log pi_S(v)``, the full-vocabulary entropy (nats);
- with a teacher source: ``lpT = log pi_T(y_t | x, y_<t)``, ``H_T``, and the exact
  ``KL(pi_S || pi_T) = sum_v pi_S(v) (log pi_S(v) - log pi_T(v))``, the per-token integrand of
  the paper's Eq. 1 / Eq. 19 (reverse KL of the student from the teacher, summed over the full
  vocabulary rather than estimated from the sampled token);
- top-k distributions (``BASELINES.md``: Token Teachability, Entropy-Aware OPD, top-k KL): the
  source's own K most probable ids and their log-probs (``top_k``; with a teacher also the
  teacher's log-probs at those ids), the teacher's K most probable ids and log-probs
  (``teacher_top_k``), and the source's log-probs at the teacher's top-K ids or at ids the caller
  gives (``gather_ids``, e.g. from a teacher-scoring service's top-k answer);
- with those lists, the exact log-mass outside them (``saopd.signals.topk``'s tail bucket): the
  source's outside the teacher's top-K or ``gather_ids`` (``tail_at_ids``) and the teacher's
  outside its own top-K (``teacher_topk_tail``), logsumexps over the unlisted entries of each
  chunk's float32 log-softmax. A tail of 1e-11 is resolved to float32's relative precision,
  which the K listed probabilities (whose sum rounds to 1) cannot give.

Top-k order and ties
--------------------
A top-K list holds, per position, the K ids with the largest log-probability, ordered by
(-log-prob, id): descending log-prob, and among equal log-probs the smaller id first, including
at the boundary (when more than K entries tie with the K-th largest value, the smallest tied ids
are the ones kept). ``torch.topk`` alone does not guarantee which tied entries it returns, so
rows with a tie across the boundary are resolved explicitly
(:func:`saopd.signals.topk.block_top_k`); the first K' <= K columns of a top-K list are
therefore exactly the top-K' list. Entries of log-prob ``-inf``
(masked vocabulary) take part like any other value: with fewer than K finite entries the
smallest masked ids fill the list, with log-prob ``-inf``.

Memory argument
---------------
The plain computation materialises fp32 logits ``[B, T, V]`` (and, in autograd, several more
tensors of that size: the log-softmax output, its gradient, ...). At Qwen's V = 151,936 and a
batch of 4 x 2048 tokens a single such tensor is 5 GB. Here the B*T positions are flattened
(row-major) and processed in chunks of ``chunk_size`` positions: only a handful of fp32
``[chunk_size, V]`` blocks exist at any time, plus per-position outputs ``[B, T]``. With the
default :func:`default_chunk_size` one block is ~256 MiB whatever V is, so the extra memory does
not grow with T (nor with V, beyond the model's own ``[V, H]`` head weight). Logits are never
stored for the whole batch: a :class:`Logits` source is only read one chunk at a time (upcast
per chunk), and an :class:`LMHead` source computes ``hidden @ weight.T + bias`` per chunk
(:mod:`saopd.signals.sources`).

Gradient mechanism
------------------
Gradients flow through a custom :class:`torch.autograd.Function` (``_ChunkedScores``). Its
forward saves only per-position tensors (targets, the entropy / KL outputs, ``[B*T]``, and the
top-k / gathered ids, ``[B*T, K]``); its
backward recomputes each chunk's logits and log-softmax (of the teacher too, when the KL has an
upstream gradient) and applies the closed-form gradients with respect to the scaled logits
u = z / tau (p = softmax(u), q the teacher's, y the target):

- d lpS / du_v = 1[v = y] - p_v, and likewise d log p_i / du_v = 1[v = i] - p_v for the
  log-prob at any gathered id i (top-k and ``gather_ids`` outputs)
- d log P_tail / du_v = 1[v not listed] p_v / P_tail - p_v for the tail outside a list
- d H_S / du_v = -p_v (log p_v + H_S)
- d KL / du_v  =  p_v (log p_v - log q_v - KL)

combines them with the upstream gradients into one ``[chunk, V]`` block g_u, and pushes
``g_u / tau`` into the source's tensors (rows of the logits, or hidden / weight / bias of the LM
head, with an fp32 accumulator for the weight). Compared with per-chunk
``torch.utils.checkpoint`` this recomputes the chunk once without re-running an autograd graph
of ~10 elementwise ops, and allocates fewer ``[chunk, V]`` temporaries; memory is flat either
way. The teacher is a constant: it never receives gradient, even if its tensors require it.
Under :func:`torch.no_grad`, or when no source tensor requires grad, no graph is kept.
Double backward is not supported.

Masked vocabulary entries (logit ``-inf``) are handled exactly: they contribute 0 to entropy and
KL (``0 * log 0 = 0``), and a target whose logit is ``-inf`` gets ``lpS = -inf`` (never NaN;
callers clamp, see ``saopd.signals.token_signals.LOGPROB_FLOOR``). If the teacher gives
probability 0 to a token the student supports, ``KL = +inf`` (the exact value) and its gradient
is undefined (NaN). A row whose logits are all ``-inf`` is not a distribution and gives NaN.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from saopd.signals.sources import LMHead, Logits, LogitSource, fp32_region
from saopd.signals.topk import block_tail, block_top_k

__all__ = ["TokenScores", "default_chunk_size", "score_tokens"]

_FP32_BYTES = 4


# ---------------------------------------------------------------------------------------------
# Results and sizes
# ---------------------------------------------------------------------------------------------


@dataclass
class TokenScores:
    """Per-token scores; every tensor is float32 ``[B, T]``, ``None`` when not requested.

    Attributes:
        logprobs: lpS = log pi_S(y_t | x, y_<t) = log softmax(z_t / tau)[y_t] under the source.
            ``-inf`` where the target's logit is ``-inf``. Differentiable w.r.t. the source.
        entropy: H_S = -sum_v pi_S(v) log pi_S(v), full-vocabulary entropy (nats).
            Differentiable w.r.t. the source.
        teacher_logprobs: lpT = log pi_T(y_t | x, y_<t), the same targets under the teacher.
            Constant (no gradient).
        teacher_entropy: H_T, full-vocabulary entropy of the teacher (nats). Constant.
        kl: exact KL(pi_S || pi_T) = sum_v pi_S(v) (log pi_S(v) - log pi_T(v)) at each
            position, the integrand of the paper's Eq. 1 / Eq. 19. Differentiable w.r.t. the
            source only (the teacher is held fixed).

    Top-k fields are ``[B, T, K]`` (K = ``top_k`` or ``teacher_top_k`` of the call), ordered
    by (-log-prob, id) (see the module docstring), ``None`` when not requested:

    Attributes:
        topk_ids: int64, the source's K most probable ids at each position.
        topk_logprobs: float32, log pi_S at ``topk_ids`` (descending). Differentiable w.r.t. the
            source (the ids themselves are a constant).
        teacher_logprobs_at_topk: float32, log pi_T at the source's ``topk_ids``. Constant.
        teacher_topk_ids: int64, the teacher's K most probable ids.
        teacher_topk_logprobs: float32, log pi_T at ``teacher_topk_ids`` (descending). Constant.
        logprobs_at_ids: float32, log pi_S at ``teacher_topk_ids`` or, when given, at the
            caller's ``gather_ids``, in their column order. Differentiable w.r.t. the source.

    Tails, ``[B, T]`` float32, with the lists above (``None`` otherwise); ``-inf`` where the
    list covers every id of nonzero probability:

    Attributes:
        tail_at_ids: log sum_{v not in ids} pi_S(v), the source's log-mass outside the ids of
            ``logprobs_at_ids``. Differentiable w.r.t. the source.
        teacher_topk_tail: log sum_{v not in teacher_topk_ids} pi_T(v). Constant.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    teacher_entropy: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    teacher_logprobs_at_topk: torch.Tensor | None = None
    teacher_topk_ids: torch.Tensor | None = None
    teacher_topk_logprobs: torch.Tensor | None = None
    logprobs_at_ids: torch.Tensor | None = None
    tail_at_ids: torch.Tensor | None = None
    teacher_topk_tail: torch.Tensor | None = None


def default_chunk_size(vocab_size: int, budget_bytes: int = 256 * 2**20) -> int:
    """Positions per chunk such that one fp32 ``[chunk, vocab_size]`` block is about
    ``budget_bytes`` (at least 1). E.g. 441 for V = 151,936 and the 256 MiB default.

    Peak extra memory is a small multiple (about 4-6) of this block: the logits, log-probs,
    probabilities and one temporary, plus the teacher's block when a teacher is scored. Top-k
    outputs add about one block (a bool ``[chunk, V]`` mask per top-k list and ``torch.topk``'s
    workspace, or the masked copy a tail's logsumexp reads, one at a time) and, only in rows
    where ties straddle the K-th value, copies of at most 1/8 of the chunk's rows with an int32
    rank (``experiments/benchmarks/topk_memory.py`` measures it).
    """
    for name, value in (("vocab_size", vocab_size), ("budget_bytes", budget_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return max(1, budget_bytes // (_FP32_BYTES * vocab_size))


# ---------------------------------------------------------------------------------------------
# The chunk loop
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """Non-tensor settings of one :func:`score_tokens` call, passed through autograd."""

    source_type: type[Logits] | type[LMHead]
    num_positions: int
    temperature: float
    chunk_size: int
    entropy: bool
    teacher: LogitSource | None
    teacher_entropy: bool
    kl: bool
    top_k: int = 0
    teacher_top_k: int = 0
    gather: bool = False

    def chunks(self) -> list[tuple[int, int]]:
        """``[start, end)`` of each chunk of flattened positions."""
        n, size = self.num_positions, self.chunk_size
        return [(start, min(start + size, n)) for start in range(0, n, size)]


def _chunk_log_probs(source: LogitSource, start: int, end: int, temperature: float
                     ) -> torch.Tensor:
    """log softmax(z / tau) of flattened positions [start, end), fp32 ``[end - start, V]``."""
    scaled = source.chunk(start, end)
    if temperature != 1.0:
        scaled = scaled / temperature
    return torch.log_softmax(scaled, dim=-1)


def _entropy(logp: torch.Tensor, p: torch.Tensor | None = None) -> torch.Tensor:
    """-sum_v p_v log p_v per row of a log-prob block (``p = exp(logp)`` if not given). Entries
    with logp = -inf contribute 0 (not 0 * -inf = NaN); one temporary block."""
    terms = logp.exp().mul_(logp) if p is None else p * logp
    return terms.masked_fill_(torch.isneginf(logp), 0.0).sum(dim=-1).neg_()



def _score_chunks(source: LogitSource, targets: torch.Tensor, gather_ids: torch.Tensor,
                  plan: _Plan) -> dict[str, torch.Tensor]:
    """The forward chunk loop. ``targets`` is flat int64 ``[N]``, ``gather_ids`` flat int64
    ``[N, K]`` (used only with ``plan.gather``); returns flat ``[N]`` / ``[N, K]`` outputs keyed
    by :class:`TokenScores` field. At most ~4 fp32 ``[chunk, V]`` blocks live at once (log p, p,
    log q and one temporary), plus the top-k masks (:func:`~saopd.signals.topk.block_top_k`)."""
    n, device = plan.num_positions, targets.device
    k_s, k_t = plan.top_k, plan.teacher_top_k
    k_at = gather_ids.shape[-1] if plan.gather else k_t
    has_teacher = plan.teacher is not None
    wanted: dict[str, tuple[bool, tuple[int, ...]]] = {  # name: (computed?, trailing shape)
        "logprobs": (True, ()), "entropy": (plan.entropy, ()),
        "teacher_logprobs": (has_teacher, ()), "teacher_entropy": (plan.teacher_entropy, ()),
        "kl": (plan.kl, ()), "topk_logprobs": (k_s > 0, (k_s,)),
        "teacher_logprobs_at_topk": (k_s > 0 and has_teacher, (k_s,)),
        "teacher_topk_logprobs": (k_t > 0, (k_t,)),
        "logprobs_at_ids": (plan.gather or k_t > 0, (k_at,)),
        "tail_at_ids": (plan.gather or k_t > 0, ()), "teacher_topk_tail": (k_t > 0, ()),
    }
    out = {name: torch.empty((n, *shape), dtype=torch.float32, device=device)
           for name, (want, shape) in wanted.items() if want}
    for name, k in (("topk_ids", k_s), ("teacher_topk_ids", k_t)):
        if k > 0:
            out[name] = torch.empty((n, k), dtype=torch.int64, device=device)
    tau = plan.temperature
    teacher = None if plan.teacher is None else plan.teacher.fp32_params()
    for start, end in plan.chunks():
        idx = targets[start:end].unsqueeze(-1)
        logp = _chunk_log_probs(source, start, end, tau)
        out["logprobs"][start:end] = logp.gather(-1, idx).squeeze(-1)
        s_ids = None
        if k_s > 0:
            s_ids, out["topk_logprobs"][start:end] = block_top_k(logp, k_s)
            out["topk_ids"][start:end] = s_ids
        if plan.gather:
            out["logprobs_at_ids"][start:end] = logp.gather(-1, gather_ids[start:end])
            out["tail_at_ids"][start:end] = block_tail(logp, gather_ids[start:end])
        p = logp.exp() if plan.kl else None
        if plan.entropy:
            out["entropy"][start:end] = _entropy(logp, p)
        if teacher is None:
            continue
        logq = _chunk_log_probs(teacher, start, end, tau)  # a fresh block: safe to modify
        out["teacher_logprobs"][start:end] = logq.gather(-1, idx).squeeze(-1)
        if s_ids is not None:
            out["teacher_logprobs_at_topk"][start:end] = logq.gather(-1, s_ids)
        if k_t > 0:
            t_ids, out["teacher_topk_logprobs"][start:end] = block_top_k(logq, k_t)
            out["teacher_topk_ids"][start:end] = t_ids
            out["teacher_topk_tail"][start:end] = block_tail(logq, t_ids)
            out["logprobs_at_ids"][start:end] = logp.gather(-1, t_ids)
            out["tail_at_ids"][start:end] = block_tail(logp, t_ids)
        if plan.teacher_entropy:
            out["teacher_entropy"][start:end] = _entropy(logq)
        if p is not None:  # KL terms p (log p - log q), 0 where p = 0 (also if log q = -inf)
            terms = logq.neg_().add_(logp).mul_(p).masked_fill_(p == 0, 0.0)
            out["kl"][start:end] = terms.sum(dim=-1)
    return out


_OUTPUTS = ("logprobs", "entropy", "teacher_logprobs", "teacher_entropy", "kl", "topk_ids",
            "topk_logprobs", "teacher_logprobs_at_topk", "teacher_topk_ids",
            "teacher_topk_logprobs", "logprobs_at_ids", "tail_at_ids", "teacher_topk_tail")
_DIFFERENTIABLE = ("logprobs", "entropy", "kl", "topk_logprobs", "logprobs_at_ids",
                   "tail_at_ids")


class _ChunkedScores(torch.autograd.Function):
    """Chunked scoring with a recomputing backward (see the module docstring).

    Inputs: ``plan`` (non-tensor), flat int64 targets ``[N]``, flat int64 ``gather_ids``
    ``[N, K]`` (empty unless ``plan.gather``), then the source's tensors. Outputs: the
    :data:`_OUTPUTS` as flat ``[N]`` / ``[N, K]`` tensors (an empty tensor when not requested).
    """

    @staticmethod
    def forward(ctx: Any, plan: _Plan, targets: torch.Tensor, gather_ids: torch.Tensor,
                *params: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        source = plan.source_type(*params)
        with fp32_region(source.device):
            out = _score_chunks(source.fp32_params(), targets, gather_ids, plan)
        empty = targets.new_empty(0, dtype=torch.float32)
        empty_ids = targets.new_empty((0, 0))
        # each missing output gets its own empty tensor: autograd wants distinct outputs
        results = tuple(out[name] if name in out else empty.clone() for name in _OUTPUTS)
        # the teacher is only needed again for the KL gradient: do not keep it alive otherwise
        ctx.plan = plan if plan.kl else dataclasses.replace(plan, teacher=None)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(
            *(r for name, r in zip(_OUTPUTS, results, strict=True)
              if name not in _DIFFERENTIABLE or name not in out)
        )
        at_ids = gather_ids if plan.gather else out.get("teacher_topk_ids", empty_ids)
        ctx.save_for_backward(targets, out.get("entropy", empty), out.get("kl", empty),
                              out.get("tail_at_ids", empty), out.get("topk_ids", empty_ids),
                              at_ids, *params)
        return results

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        plan: _Plan = ctx.plan
        targets, entropy, kl, tail, topk_ids, at_ids, *params = ctx.saved_tensors
        g = dict(zip(_OUTPUTS, grads, strict=True))
        lists = plan.gather or plan.teacher_top_k > 0
        upstream = _Upstream(
            lp=g["logprobs"], entropy=g["entropy"] if plan.entropy else None,
            kl=g["kl"] if plan.kl else None,
            topk=g["topk_logprobs"] if plan.top_k > 0 else None,
            at_ids=g["logprobs_at_ids"] if lists else None,
            tail=g["tail_at_ids"] if lists else None)
        needs = tuple(ctx.needs_input_grad[3:])
        if upstream.empty() or not any(needs):
            return (None, None, None, *([None] * len(params)))
        source = plan.source_type(*params).fp32_params()
        with fp32_region(source.device):
            grads_in = _backward_chunks(plan, source, targets, _Saved(entropy, kl, tail),
                                        topk_ids, at_ids, tuple(params), needs, upstream)
        return (None, None, None, *grads_in)


@dataclass(frozen=True)
class _Upstream:
    """Upstream gradients of the differentiable outputs (flat; ``None`` = no gradient)."""

    lp: torch.Tensor | None  # [N]
    entropy: torch.Tensor | None  # [N]
    kl: torch.Tensor | None  # [N]
    topk: torch.Tensor | None  # [N, K] of topk_logprobs
    at_ids: torch.Tensor | None  # [N, K] of logprobs_at_ids
    tail: torch.Tensor | None  # [N] of tail_at_ids

    def empty(self) -> bool:
        return all(v is None for v in (self.lp, self.entropy, self.kl, self.topk, self.at_ids,
                                       self.tail))


@dataclass(frozen=True)
class _Saved:
    """Per-position forward outputs the backward reuses (flat ``[N]``; empty when not
    computed)."""

    entropy: torch.Tensor
    kl: torch.Tensor
    tail: torch.Tensor  # tail_at_ids


def _backward_chunks(plan: _Plan, source: LogitSource, targets: torch.Tensor,
                     saved: _Saved, topk_ids: torch.Tensor, at_ids: torch.Tensor,
                     params: tuple[torch.Tensor | None, ...], needs: tuple[bool, ...],
                     up: _Upstream) -> list[torch.Tensor | None]:
    """The backward chunk loop of :class:`_ChunkedScores` (fp32 ``source``; flat ``[N]``
    targets, saved entropy / KL / tail, ``[N, K]`` top-k and gathered ids, upstream
    gradients); returns the gradients of the source's tensors.

    Every gathered log-prob (the target's, the top-k's, those at ``at_ids``) has
    d log p_i / du_v = 1[v = i] - p_v, so their part of the gradient is
    ``scatter(ids, g) - p * sum(g)`` over all of them at once."""
    bufs = source.grad_buffers(needs)
    teacher = None if up.kl is None or plan.teacher is None else plan.teacher.fp32_params()
    tau = plan.temperature
    for start, end in plan.chunks():
        rows = slice(start, end)
        logp = _chunk_log_probs(source, start, end, tau)
        p = logp.exp()
        zero = p == 0 if up.entropy is not None or up.kl is not None else None
        # the gradient w.r.t. the scaled logits u = z / tau, built as one [chunk, V] block
        extra = None  # entropy and KL parts
        if up.entropy is not None:  # dH/du = -p (log p + H)
            extra = (logp + saved.entropy[rows, None]).mul_(p).masked_fill_(zero, 0.0)
            extra.mul_(up.entropy[rows, None].neg())
        if up.kl is not None:  # dKL/du = p (log p - log q - KL)
            term = _chunk_log_probs(teacher, start, end, tau).neg_().add_(logp)
            term.sub_(saved.kl[rows, None]).mul_(p).masked_fill_(zero, 0.0)
            term.mul_(up.kl[rows, None])
            extra = term if extra is None else extra.add_(term)
            del term
        if up.tail is not None:  # d log P_tail / du = 1[v not listed] p / P_tail - p
            tail = saved.tail[rows, None]
            finite = torch.isfinite(tail)  # -inf: nothing left outside the list, no gradient
            g_tail = torch.where(finite, up.tail[rows, None], 0.0)
            term = (logp - torch.where(finite, tail, 0.0)).exp_()
            term.scatter_(-1, at_ids[rows], 0.0).sub_(p).mul_(g_tail)
            extra = term if extra is None else extra.add_(term)
            del term
        del logp, zero
        gathered = [(ids, g) for ids, g in ((targets[rows, None], up.lp), (topk_ids[rows], up.topk),
                                            (at_ids[rows], up.at_ids)) if g is not None]
        if not gathered:
            grad = extra
        else:  # d log p_i / du = onehot(i) - p, for every gathered id i
            g_rows = [g[rows, None] if g.dim() == 1 else g[rows] for _, g in gathered]
            total = g_rows[0].sum(dim=-1, keepdim=True)
            for g_row in g_rows[1:]:
                total = total + g_row.sum(dim=-1, keepdim=True)
            grad = p.mul_(total.neg_())
            for (ids, _), g_row in zip(gathered, g_rows, strict=True):
                grad.scatter_add_(-1, ids, g_row)
            if extra is not None:
                grad.add_(extra)
        del p, extra
        if tau != 1.0:
            grad.div_(tau)
        source.accumulate_grad(bufs, grad, start, end)
        del grad
    return source.finish_grads(bufs, params)


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------


def _check_source(name: str, source: Any) -> None:
    if not isinstance(source, (Logits, LMHead)):
        raise ValueError(
            f"{name} must be a Logits or LMHead, got {type(source).__name__}")


def _check_ids(name: str, ids: torch.Tensor, shape: tuple[int, int], vocab: int,
               device: torch.device) -> torch.Tensor:
    """Integer ids in ``[0, V)`` of shape ``[B, T, K]`` (K >= 1), as int64 on ``device``."""
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"{name} must be an integer (int64) tensor, got dtype {ids.dtype}")
    if ids.dim() != 3 or tuple(ids.shape[:2]) != shape or ids.shape[2] < 1:
        raise ValueError(f"{name} must have shape [B, T, K] = [{shape[0]}, {shape[1]}, K >= 1], "
                         f"got {tuple(ids.shape)}")
    ids = ids.to(device=device, dtype=torch.int64)
    if ids.numel() > 0:
        bad = (ids < 0) | (ids >= vocab)
        if bool(bad.any()):
            raise ValueError(f"{name} must be token ids in [0, V) with V = {vocab}, got "
                             f"{int(ids[bad][0])} ({int(bad.sum())} id(s) out of range)")
    return ids


def _check_k(name: str, k: Any, vocab: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= vocab:
        raise ValueError(f"{name} must be an int in [0, V] with V = {vocab} (0 = off), got {k!r}")
    return k


def score_tokens(source: LogitSource, targets: torch.Tensor, *,
                 teacher: LogitSource | None = None, entropy: bool = False,
                 teacher_entropy: bool = False, kl: bool = False, top_k: int = 0,
                 teacher_top_k: int = 0, gather_ids: torch.Tensor | None = None,
                 temperature: float = 1.0, chunk_size: int | None = None) -> TokenScores:
    """Score ``targets`` under ``source`` (and ``teacher``) one chunk of positions at a time.

    Args:
        source: the scored model (student): :class:`Logits` ``[B, T, V]`` or :class:`LMHead`.
        targets: integer ``[B, T]`` token ids in ``[0, V)``; position t is scored with the
            logits at position t (shift before calling).
        teacher: optional second source with the same ``(B, T)`` and V, treated as a constant.
        entropy: also return H_S. teacher_entropy: also return H_T (needs ``teacher``).
        kl: also return the exact KL(pi_S || pi_T) per position (needs ``teacher``).
        top_k: K > 0 also returns the source's top-K ids and log-probs (``topk_ids``,
            ``topk_logprobs``) and, with a teacher, the teacher's log-probs at those ids
            (``teacher_logprobs_at_topk``); 0 = off.
        teacher_top_k: K > 0 (needs ``teacher``) also returns the teacher's top-K ids and
            log-probs (``teacher_topk_ids``, ``teacher_topk_logprobs``) and the source's
            log-probs at those ids (``logprobs_at_ids``), with both log-masses outside them
            (``teacher_topk_tail``, ``tail_at_ids``); 0 = off.
        gather_ids: integer ``[B, T, K]`` ids in ``[0, V)``: return the source's log-probs at
            them (``logprobs_at_ids``) and its log-mass outside them (``tail_at_ids``), e.g. at
            the top-K ids a teacher-scoring service gave. Exclusive with ``teacher_top_k``.
        temperature: tau > 0; every distribution is softmax(z / tau).
        chunk_size: positions per chunk; default :func:`default_chunk_size` (V).

    Returns:
        :class:`TokenScores` with float32 ``[B, T]`` (``[B, T, K]`` for top-k fields; int64
        ids) tensors on the source's device. When grad is enabled and the source's tensors
        require grad, ``logprobs``, ``entropy``, ``kl``, ``topk_logprobs``,
        ``logprobs_at_ids`` and ``tail_at_ids`` are differentiable w.r.t. them (recomputing
        backward, flat memory).

    Raises:
        ValueError: bad source/teacher type, mismatched shapes or devices, targets or
            gather_ids not integer, out of range or of the wrong shape, temperature not > 0,
            chunk_size < 1, a top-k outside [0, V], teacher_entropy/kl/teacher_top_k without
            teacher, gather_ids together with teacher_top_k.
    """
    _check_source("source", source)
    if teacher is not None:
        _check_source("teacher", teacher)
    elif teacher_entropy or kl or teacher_top_k:
        wanted = [f"{n}={v!r}" for n, v in (("teacher_entropy", teacher_entropy), ("kl", kl),
                                            ("teacher_top_k", teacher_top_k)) if v]
        raise ValueError(f"{' and '.join(wanted)} needs a teacher source, got teacher=None")
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
            or not math.isfinite(temperature) or temperature <= 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    batch, vocab = source.batch_shape, source.vocab_size
    if chunk_size is None:
        chunk_size = default_chunk_size(vocab)
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")

    if not isinstance(targets, torch.Tensor):
        raise ValueError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
    if targets.dtype == torch.bool or targets.is_floating_point() or targets.is_complex():
        raise ValueError(f"targets must be an integer (int64) tensor, got dtype {targets.dtype}")
    if tuple(targets.shape) != batch:
        raise ValueError(
            f"targets has shape {tuple(targets.shape)} but source has batch shape {batch} "
            f"(logits [B, T, V] = {(*batch, vocab)})"
        )
    if teacher is not None:
        t_shape = (*teacher.batch_shape, teacher.vocab_size)
        if t_shape != (*batch, vocab):
            raise ValueError(
                f"teacher has shape [B, T, V] = {t_shape} but source has {(*batch, vocab)}")
        if teacher.device != source.device:
            raise ValueError(f"teacher is on {teacher.device} but source is on {source.device}")
    targets = targets.to(device=source.device, dtype=torch.int64)
    if targets.numel() > 0:
        bad = (targets < 0) | (targets >= vocab)
        if bool(bad.any()):
            value = int(targets[bad][0])
            raise ValueError(
                f"targets must be token ids in [0, V) with V = {vocab}, got {value} "
                f"({int(bad.sum())} id(s) out of range)"
            )

    top_k = _check_k("top_k", top_k, vocab)
    teacher_top_k = _check_k("teacher_top_k", teacher_top_k, vocab)
    flat_ids = targets.new_empty((0, 0))
    if gather_ids is not None:
        if teacher_top_k:
            raise ValueError("gather_ids and teacher_top_k both define logprobs_at_ids: give "
                             "one of them")
        gather_ids = _check_ids("gather_ids", gather_ids, batch, vocab, source.device)
        flat_ids = gather_ids.reshape(-1, gather_ids.shape[-1])

    plan = _Plan(
        source_type=type(source), num_positions=batch[0] * batch[1],
        temperature=float(temperature), chunk_size=chunk_size, entropy=entropy,
        teacher=teacher, teacher_entropy=teacher_entropy, kl=kl, top_k=top_k,
        teacher_top_k=teacher_top_k, gather=gather_ids is not None,
    )
    flat = _ChunkedScores.apply(plan, targets.reshape(-1), flat_ids, *source.tensors())
    has_teacher = teacher is not None
    at_ids = teacher_top_k > 0 or gather_ids is not None
    wanted = (True, entropy, has_teacher, teacher_entropy, kl, top_k > 0, top_k > 0,
              top_k > 0 and has_teacher, teacher_top_k > 0, teacher_top_k > 0, at_ids, at_ids,
              teacher_top_k > 0)
    return TokenScores(*(value.view(*batch, *value.shape[1:]) if want else None
                         for value, want in zip(flat, wanted, strict=True)))
