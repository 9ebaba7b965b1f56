"""Where :func:`saopd.signals.logprobs.score_tokens` reads logits from, one chunk of positions
at a time.

A *logit source* holds a batch's ``[B, T, V]`` logits without materialising them in fp32:

- :class:`Logits`: logits the model already computed (any float dtype, possibly a
  non-contiguous view such as ``logits[:, :-1]``), upcast one chunk at a time;
- :class:`LMHead`: the hidden states before the LM head, ``[B, T, H]``, with its ``[V, H]``
  weight (and ``[V]`` bias): ``hidden @ weight.T + bias`` is computed per chunk in fp32.

Positions are flattened row-major (``B*T``); :meth:`chunk` gives the fp32 ``[end - start, V]``
logits of flattened positions ``[start, end)``. Besides ``batch_shape``, ``vocab_size``,
``device`` and ``chunk``, a source implements the scoring protocol the chunked autograd function
of :mod:`saopd.signals.logprobs` drives: ``tensors()`` (the tensors gradients flow into, in the
order of the source's constructor), ``fp32_params()`` (the same source with fp32 parameters),
``grad_buffers(needs)``, ``accumulate_grad(bufs, grad, start, end)`` (add the gradient w.r.t.
one chunk's logits, ``[end - start, V]``) and ``finish_grads(bufs, originals)`` (the gradients
in the tensors' dtypes).

Every chunk is computed with autocast off (:func:`fp32_region`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LMHead", "LogitSource", "Logits", "fp32_region"]


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

    # -- the scoring protocol (module docstring) ----------------------------------------------
    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        return (self.logits,)

    def fp32_params(self) -> Logits:
        return self

    def grad_buffers(self, needs: tuple[bool, ...]) -> list[torch.Tensor | None]:
        return [torch.zeros_like(self.logits, memory_format=torch.contiguous_format)
                if needs[0] else None]

    def accumulate_grad(self, bufs: list[torch.Tensor | None], grad: torch.Tensor,
                         start: int, end: int) -> None:
        if bufs[0] is not None:
            bufs[0].view(-1, self.vocab_size)[start:end] = grad

    def finish_grads(self, bufs: list[torch.Tensor | None],
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

    # -- the scoring protocol (module docstring) ----------------------------------------------
    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        return (self.hidden, self.weight, self.bias)

    def fp32_params(self) -> LMHead:
        """The same head with fp32 weight/bias (``self`` when they already are fp32)."""
        fp32 = self.weight.dtype == torch.float32 and (
            self.bias is None or self.bias.dtype == torch.float32)
        if fp32:
            return self
        bias = None if self.bias is None else self.bias.float()
        return LMHead(self.hidden, self.weight.float(), bias)

    def grad_buffers(self, needs: tuple[bool, ...]) -> list[torch.Tensor | None]:
        hidden, weight, bias = self.hidden, self.weight, self.bias
        return [
            torch.zeros_like(hidden, memory_format=torch.contiguous_format) if needs[0] else None,
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if needs[1] else None,
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
            if bias is not None and needs[2] else None,
        ]

    def accumulate_grad(self, bufs: list[torch.Tensor | None], grad: torch.Tensor,
                         start: int, end: int) -> None:
        grad_hidden, grad_weight, grad_bias = bufs
        if grad_hidden is not None:  # self.weight is fp32 here (see fp32_params)
            grad_hidden.view(-1, grad_hidden.shape[-1])[start:end] = grad @ self.weight
        if grad_weight is not None:
            rows = _flat_rows(self.hidden, start, end).float()
            grad_weight.addmm_(grad.T, rows)
        if grad_bias is not None:
            grad_bias.add_(grad.sum(dim=0))

    def finish_grads(self, bufs: list[torch.Tensor | None],
                      originals: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for buf, orig in zip(bufs, originals, strict=True):
            out.append(None if buf is None or orig is None else buf.to(orig.dtype))
        return out


LogitSource = Logits | LMHead
"""Anything :func:`score_tokens` can read logits from, one chunk of positions at a time."""
