"""Chunked per-token scoring of a language model's next-token distribution.

For every position t of a batch of sequences this module computes, from the model's logits z_t
over a vocabulary of V tokens (softmax at ``temperature`` tau):

- ``lpS = log pi_S(y_t | x, y_<t)`` = log softmax(z_t / tau)[y_t], the log-probability of the
  target (sampled) token y_t;
- ``H_S = -sum_v pi_S(v) log pi_S(v)``, the full-vocabulary entropy (nats);
- with a teacher source: ``lpT = log pi_T(y_t | x, y_<t)``, ``H_T``, and the exact
  ``KL(pi_S || pi_T) = sum_v pi_S(v) (log pi_S(v) - log pi_T(v))``, the per-token integrand of
  the paper's Eq. 1 / Eq. 19 (reverse KL of the student from the teacher, summed over the full
  vocabulary rather than estimated from the sampled token).

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
per chunk), and an :class:`LMHead` source computes ``hidden @ weight.T + bias`` per chunk.

Gradient mechanism
------------------
Gradients flow through a custom :class:`torch.autograd.Function` (``_ChunkedScores``). Its
forward saves only per-position tensors (targets and the entropy / KL outputs, ``[B*T]``); its
backward recomputes each chunk's logits and log-softmax (of the teacher too, when the KL has an
upstream gradient) and applies the closed-form gradients with respect to the scaled logits
u = z / tau (p = softmax(u), q the teacher's, y the target):

- d lpS / du_v = 1[v = y] - p_v
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

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "LMHead",
    "LogitSource",
    "Logits",
    "TokenScores",
    "default_chunk_size",
    "fp32_region",
    "score_tokens",
]

_FP32_BYTES = 4


def fp32_region(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """A context in which autocast is off for ``device``'s type, so every op runs in the dtype
    of its inputs (here always fp32).

    Under Lightning's ``bf16-mixed`` (``torch.autocast``) a ``matmul``/``addmm`` of fp32 tensors
    would otherwise run in bf16: the LM-head product of :class:`LMHead` would lose 8 bits of
    mantissa before the log-softmax, which moved log-probs by ~0.08 nats on average. Scoring
    runs inside this context in the forward and the backward, whatever autocast state the caller
    (or the autograd engine) is in; the model's own layers keep their mixed precision.
    """
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# Sources of logits
# ---------------------------------------------------------------------------------------------


def _check_float(name: str, tensor: Any, ndim: int) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)}")


def _flat_rows(x: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of ``x`` ([B, T, D]) flattened row-major to [B*T, D], without copying
    the whole tensor when ``x`` is not viewable as [B*T, D] (e.g. a ``[:, :-1]`` slice)."""
    width = x.shape[-1]
    try:
        return x.view(-1, width)[start:end]
    except RuntimeError:  # strides do not allow a flat view: gather the per-sequence pieces
        seq_len = x.shape[1]
        pieces = []
        for b in range(start // seq_len, (end - 1) // seq_len + 1):
            lo = max(start, b * seq_len) - b * seq_len
            hi = min(end, (b + 1) * seq_len) - b * seq_len
            pieces.append(x[b, lo:hi])
        return torch.cat(pieces, dim=0) if pieces else x.new_empty((0, width))


def _check_range(start: int, end: int, n: int) -> None:
    if not 0 <= start <= end <= n:
        raise ValueError(f"chunk range [{start}, {end}) is not inside [0, {n}]")


@dataclass(frozen=True)
class Logits:
    """Logits already computed by the model.

    Attributes:
        logits: ``[B, T, V]`` tensor of any float dtype (bf16/fp16 are upcast one chunk at a
            time). It may be a non-contiguous view (e.g. ``logits[:, :-1]``).
    """

    logits: torch.Tensor

    def __post_init__(self) -> None:
        _check_float("Logits.logits", self.logits, 3)

    @property
    def batch_shape(self) -> tuple[int, int]:
        """``(B, T)``."""
        return (int(self.logits.shape[0]), int(self.logits.shape[1]))

    @property
    def vocab_size(self) -> int:
        """``V``."""
        return int(self.logits.shape[2])

    @property
    def device(self) -> torch.device:
        return self.logits.device

    def chunk(self, start: int, end: int) -> torch.Tensor:
        """float32 ``[end - start, V]`` logits of flattened positions [start, end).

        For fp32 input this may be a view of ``logits``: do not modify it in place.
        """
        b, t = self.batch_shape
        _check_range(start, end, b * t)
        return _flat_rows(self.logits, start, end).float()

    # -- internals used by score_tokens -------------------------------------------------------
    def _tensors(self) -> tuple[torch.Tensor | None, ...]:
        return (self.logits,)

    def _fp32_params(self) -> Logits:
        return self

    def _grad_buffers(self, needs: tuple[bool, ...]) -> list[torch.Tensor | None]:
        return [torch.zeros_like(self.logits, memory_format=torch.contiguous_format)
                if needs[0] else None]

    def _accumulate_grad(self, bufs: list[torch.Tensor | None], grad: torch.Tensor,
                         start: int, end: int) -> None:
        if bufs[0] is not None:
            bufs[0].view(-1, self.vocab_size)[start:end] = grad

    def _finish_grads(self, bufs: list[torch.Tensor | None],
                      originals: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
        return bufs


@dataclass(frozen=True)
class LMHead:
    """Hidden states before the LM head; ``logits = hidden @ weight.T + bias``.

    The product is computed per chunk in float32. Inside :func:`score_tokens`, low-precision
    ``weight``/``bias`` are upcast once for the forward loop and once for the backward loop (one
    fp32 ``[V, H]`` copy alive while a loop runs); :meth:`chunk` itself upcasts on every call.

    Attributes:
        hidden: ``[B, T, H]`` float tensor (may be a non-contiguous view).
        weight: ``[V, H]`` float tensor (the LM head / tied embedding matrix).
        bias: optional ``[V]`` float tensor.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        _check_float("LMHead.hidden", self.hidden, 3)
        _check_float("LMHead.weight", self.weight, 2)
        if self.weight.shape[1] != self.hidden.shape[2]:
            raise ValueError(
                f"LMHead.weight has shape {tuple(self.weight.shape)} but LMHead.hidden has "
                f"{tuple(self.hidden.shape)}: weight must be [V, H] with H = hidden.shape[-1]"
            )
        if self.bias is not None:
            _check_float("LMHead.bias", self.bias, 1)
            if self.bias.shape[0] != self.weight.shape[0]:
                raise ValueError(
                    f"LMHead.bias has shape {tuple(self.bias.shape)} but LMHead.weight has "
                    f"{tuple(self.weight.shape)}: bias must be [V]"
                )
        for name, tensor in (("weight", self.weight), ("bias", self.bias)):
            if tensor is not None and tensor.device != self.hidden.device:
                raise ValueError(
                    f"LMHead.{name} is on {tensor.device} but LMHead.hidden is on "
                    f"{self.hidden.device}"
                )

    @property
    def batch_shape(self) -> tuple[int, int]:
        """``(B, T)``."""
        return (int(self.hidden.shape[0]), int(self.hidden.shape[1]))

    @property
    def vocab_size(self) -> int:
        """``V``."""
        return int(self.weight.shape[0])

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def chunk(self, start: int, end: int) -> torch.Tensor:
        """float32 ``[end - start, V]`` logits of flattened positions [start, end), computed in
        fp32 even inside ``torch.autocast`` (see :func:`fp32_region`)."""
        b, t = self.batch_shape
        _check_range(start, end, b * t)
        with fp32_region(self.device):
            rows = _flat_rows(self.hidden, start, end).float()
            weight = self.weight.float()
            if self.bias is None:
                return rows @ weight.T
            return torch.addmm(self.bias.float(), rows, weight.T)

    # -- internals used by score_tokens -------------------------------------------------------
    def _tensors(self) -> tuple[torch.Tensor | None, ...]:
        return (self.hidden, self.weight, self.bias)

    def _fp32_params(self) -> LMHead:
        """The same head with fp32 weight/bias (``self`` when they already are fp32)."""
        fp32 = self.weight.dtype == torch.float32 and (
            self.bias is None or self.bias.dtype == torch.float32)
        if fp32:
            return self
        bias = None if self.bias is None else self.bias.float()
        return LMHead(self.hidden, self.weight.float(), bias)

    def _grad_buffers(self, needs: tuple[bool, ...]) -> list[torch.Tensor | None]:
        hidden, weight, bias = self.hidden, self.weight, self.bias
        return [
            torch.zeros_like(hidden, memory_format=torch.contiguous_format) if needs[0] else None,
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if needs[1] else None,
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
            if bias is not None and needs[2] else None,
        ]

    def _accumulate_grad(self, bufs: list[torch.Tensor | None], grad: torch.Tensor,
                         start: int, end: int) -> None:
        grad_hidden, grad_weight, grad_bias = bufs
        if grad_hidden is not None:  # self.weight is fp32 here (see _fp32_params)
            grad_hidden.view(-1, grad_hidden.shape[-1])[start:end] = grad @ self.weight
        if grad_weight is not None:
            rows = _flat_rows(self.hidden, start, end).float()
            grad_weight.addmm_(grad.T, rows)
        if grad_bias is not None:
            grad_bias.add_(grad.sum(dim=0))

    def _finish_grads(self, bufs: list[torch.Tensor | None],
                      originals: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for buf, orig in zip(bufs, originals, strict=True):
            out.append(None if buf is None or orig is None else buf.to(orig.dtype))
        return out


LogitSource = Logits | LMHead
"""Anything :func:`score_tokens` can read logits from, one chunk of positions at a time."""


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
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    teacher_entropy: torch.Tensor | None = None
    kl: torch.Tensor | None = None


def default_chunk_size(vocab_size: int, budget_bytes: int = 256 * 2**20) -> int:
    """Positions per chunk such that one fp32 ``[chunk, vocab_size]`` block is about
    ``budget_bytes`` (at least 1). E.g. 441 for V = 151,936 and the 256 MiB default.

    Peak extra memory is a small multiple (about 4-6) of this block: the logits, log-probs,
    probabilities and one temporary, plus the teacher's block when a teacher is scored.
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


def _score_chunks(source: LogitSource, targets: torch.Tensor, plan: _Plan
                  ) -> dict[str, torch.Tensor]:
    """The forward chunk loop. ``targets`` is flat int64 ``[N]``; returns flat fp32 ``[N]``
    outputs keyed by :class:`TokenScores` field. At most ~4 fp32 ``[chunk, V]`` blocks live at
    once (log p, p, log q and one temporary)."""
    n, device = plan.num_positions, targets.device
    wanted = {"logprobs": True, "entropy": plan.entropy,
              "teacher_logprobs": plan.teacher is not None,
              "teacher_entropy": plan.teacher_entropy, "kl": plan.kl}
    out = {name: torch.empty(n, dtype=torch.float32, device=device)
           for name, want in wanted.items() if want}
    tau = plan.temperature
    teacher = None if plan.teacher is None else plan.teacher._fp32_params()
    for start, end in plan.chunks():
        idx = targets[start:end].unsqueeze(-1)
        logp = _chunk_log_probs(source, start, end, tau)
        out["logprobs"][start:end] = logp.gather(-1, idx).squeeze(-1)
        p = logp.exp() if plan.kl else None
        if plan.entropy:
            out["entropy"][start:end] = _entropy(logp, p)
        if teacher is None:
            continue
        logq = _chunk_log_probs(teacher, start, end, tau)  # a fresh block: safe to modify
        out["teacher_logprobs"][start:end] = logq.gather(-1, idx).squeeze(-1)
        if plan.teacher_entropy:
            out["teacher_entropy"][start:end] = _entropy(logq)
        if p is not None:  # KL terms p (log p - log q), 0 where p = 0 (also if log q = -inf)
            terms = logq.neg_().add_(logp).mul_(p).masked_fill_(p == 0, 0.0)
            out["kl"][start:end] = terms.sum(dim=-1)
    return out


_OUTPUTS = ("logprobs", "entropy", "teacher_logprobs", "teacher_entropy", "kl")
_DIFFERENTIABLE = ("logprobs", "entropy", "kl")


class _ChunkedScores(torch.autograd.Function):
    """Chunked scoring with a recomputing backward (see the module docstring).

    Inputs: ``plan`` (non-tensor), flat int64 targets, then the source's tensors. Outputs: the
    five :data:`_OUTPUTS` as flat fp32 ``[N]`` (an empty tensor when not requested).
    """

    @staticmethod
    def forward(ctx: Any, plan: _Plan, targets: torch.Tensor,
                *params: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        source = plan.source_type(*params)
        with fp32_region(source.device):
            out = _score_chunks(source._fp32_params(), targets, plan)
        empty = targets.new_empty(0, dtype=torch.float32)
        # each missing output gets its own empty tensor: autograd wants distinct outputs
        results = tuple(out[name] if name in out else empty.clone() for name in _OUTPUTS)
        # the teacher is only needed again for the KL gradient: do not keep it alive otherwise
        ctx.plan = plan if plan.kl else dataclasses.replace(plan, teacher=None)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(
            *(r for name, r in zip(_OUTPUTS, results, strict=True)
              if name not in _DIFFERENTIABLE or name not in out)
        )
        ctx.save_for_backward(targets, out.get("entropy", empty), out.get("kl", empty),
                              *params)
        return results

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        plan: _Plan = ctx.plan
        targets, entropy, kl, *params = ctx.saved_tensors
        g_lp, g_h, _, _, g_kl = grads
        g_h = g_h if plan.entropy else None
        g_kl = g_kl if plan.kl else None
        needs = tuple(ctx.needs_input_grad[2:])
        if (g_lp is None and g_h is None and g_kl is None) or not any(needs):
            return (None, None, *([None] * len(params)))
        source = plan.source_type(*params)._fp32_params()
        with fp32_region(source.device):
            return _backward_chunks(plan, source, targets, entropy, kl, tuple(params),
                                    needs, g_lp, g_h, g_kl)


def _backward_chunks(plan: _Plan, source: LogitSource, targets: torch.Tensor,
                     entropy: torch.Tensor, kl: torch.Tensor,
                     params: tuple[torch.Tensor | None, ...], needs: tuple[bool, ...],
                     g_lp: torch.Tensor | None, g_h: torch.Tensor | None,
                     g_kl: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The backward chunk loop of :class:`_ChunkedScores` (fp32 ``source``; flat ``[N]``
    targets, saved entropy / KL and upstream gradients); returns the gradients of its inputs."""
    bufs = source._grad_buffers(needs)
    teacher = None if g_kl is None or plan.teacher is None else plan.teacher._fp32_params()
    tau = plan.temperature
    for start, end in plan.chunks():
        rows = slice(start, end)
        logp = _chunk_log_probs(source, start, end, tau)
        p = logp.exp()
        zero = p == 0 if g_h is not None or g_kl is not None else None
        # the gradient w.r.t. the scaled logits u = z / tau, built as one [chunk, V] block
        extra = None  # entropy and KL parts
        if g_h is not None:  # dH/du = -p (log p + H)
            extra = (logp + entropy[rows, None]).mul_(p).masked_fill_(zero, 0.0)
            extra.mul_(g_h[rows, None].neg())
        if g_kl is not None:  # dKL/du = p (log p - log q - KL)
            term = _chunk_log_probs(teacher, start, end, tau).neg_().add_(logp)
            term.sub_(kl[rows, None]).mul_(p).masked_fill_(zero, 0.0)
            term.mul_(g_kl[rows, None])
            extra = term if extra is None else extra.add_(term)
            del term
        del logp, zero
        if g_lp is None:
            grad = extra
        else:  # dlp/du = onehot(y) - p
            grad = p.mul_(g_lp[rows, None].neg())
            grad.scatter_add_(-1, targets[rows, None], g_lp[rows, None])
            if extra is not None:
                grad.add_(extra)
        del p, extra
        if tau != 1.0:
            grad.div_(tau)
        source._accumulate_grad(bufs, grad, start, end)
        del grad
    return (None, None, *source._finish_grads(bufs, params))


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------


def _check_source(name: str, source: Any) -> None:
    if not isinstance(source, (Logits, LMHead)):
        raise ValueError(
            f"{name} must be a Logits or LMHead, got {type(source).__name__}")


def score_tokens(source: LogitSource, targets: torch.Tensor, *,
                 teacher: LogitSource | None = None, entropy: bool = False,
                 teacher_entropy: bool = False, kl: bool = False, temperature: float = 1.0,
                 chunk_size: int | None = None) -> TokenScores:
    """Score ``targets`` under ``source`` (and ``teacher``) one chunk of positions at a time.

    Args:
        source: the scored model (student): :class:`Logits` ``[B, T, V]`` or :class:`LMHead`.
        targets: integer ``[B, T]`` token ids in ``[0, V)``; position t is scored with the
            logits at position t (shift before calling).
        teacher: optional second source with the same ``(B, T)`` and V, treated as a constant.
        entropy: also return H_S. teacher_entropy: also return H_T (needs ``teacher``).
        kl: also return the exact KL(pi_S || pi_T) per position (needs ``teacher``).
        temperature: tau > 0; every distribution is softmax(z / tau).
        chunk_size: positions per chunk; default :func:`default_chunk_size` (V).

    Returns:
        :class:`TokenScores` with float32 ``[B, T]`` tensors on the source's device. When grad
        is enabled and the source's tensors require grad, ``logprobs``, ``entropy`` and ``kl``
        are differentiable w.r.t. them (recomputing backward, flat memory).

    Raises:
        ValueError: bad source/teacher type, mismatched shapes or devices, targets not integer,
            out of range, temperature not > 0, chunk_size < 1, teacher_entropy/kl without
            teacher.
    """
    _check_source("source", source)
    if teacher is not None:
        _check_source("teacher", teacher)
    elif teacher_entropy or kl:
        wanted = [n for n, v in (("teacher_entropy", teacher_entropy), ("kl", kl)) if v]
        raise ValueError(f"{' and '.join(wanted)}=True needs a teacher source, got teacher=None")
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

    plan = _Plan(
        source_type=type(source), num_positions=batch[0] * batch[1],
        temperature=float(temperature), chunk_size=chunk_size, entropy=entropy,
        teacher=teacher, teacher_entropy=teacher_entropy, kl=kl,
    )
    flat = _ChunkedScores.apply(plan, targets.reshape(-1), *source._tensors())
    wanted = (True, entropy, teacher is not None, teacher_entropy, kl)
    return TokenScores(*(value.view(batch) if want else None
                         for value, want in zip(flat, wanted, strict=True)))
