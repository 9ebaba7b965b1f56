"""Context batches: one row's contexts (:class:`Contexts`), padded batches of them
(:class:`ContextBatch`, :class:`PairedContextBatch`, with ``rows(slice)`` for micro-batches)
and the gather of response log-probs; the same for text and vision-language pairs.

Position convention: with ``ids = prefix + response`` and ``start = len(prefix)``, the logits at
position ``start + i - 1`` predict response token ``i``. Batches are right-padded by default
(every row starts at position 0, no ``position_ids`` needed); ``padding_side="left"`` gives
``position_ids`` to pass to the model. Never infer masks from pad ids: SmolLM2's pad token is
its EOS ``<|im_end|>``, which ends most responses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from saopd.choices import PADDING_SIDES, TRUNCATION_MODES
from saopd.validation import check_choice

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "IGNORE_INDEX",
    "ContextBatch",
    "Contexts",
    "PairedContextBatch",
    "gather_response_logprobs",
    "pad_contexts",
    "resolve_pad_id",
    "response_positions",
]

#: Label of every position that is not a response token (the HF convention).
IGNORE_INDEX = -100


def response_positions(start: int, length: int) -> list[int]:
    """Positions ``start - 1 + i`` (i < length) whose logits predict the response tokens.

    ``start`` is the index of the first response token in the context ids; it must be >= 1.
    """
    if start < 1:
        raise ValueError(f"start must be >= 1 (a token must precede the response), got {start}")
    return list(range(start - 1, start - 1 + length))


@dataclass(frozen=True)
class Contexts:
    """The two contexts of one response.

    ``full_ids[full_start:] == residual_ids[residual_start:] == response_ids`` (length ``R``).
    """

    full_ids: list[int]
    residual_ids: list[int]
    full_start: int
    residual_start: int

    @property
    def response_ids(self) -> list[int]:
        return self.full_ids[self.full_start :]

    @property
    def response_len(self) -> int:
        return len(self.full_ids) - self.full_start

    @property
    def full_positions(self) -> list[int]:
        """Logit positions in the full context predicting the response tokens, length ``R``."""
        return response_positions(self.full_start, self.response_len)

    @property
    def residual_positions(self) -> list[int]:
        """Logit positions in the residual context predicting the response tokens, length ``R``."""
        return response_positions(self.residual_start, self.response_len)


@dataclass(frozen=True)
class ContextBatch:
    """One context (full or residual) of a batch, padded to length ``T``.

    - ``input_ids`` [B, T] long, pad positions hold the pad id;
    - ``attention_mask`` [B, T] long, 1 on real tokens;
    - ``position_ids`` [B, T] long: ``arange`` for right padding; for left padding
      ``cumsum(mask) - 1`` (pad positions 1, as HF generate): pass it to the model then;
    - ``labels`` [B, T] long: the response token at response positions, -100 elsewhere (HF
      convention: the model shifts internally);
    - ``gather_index`` [B, R] long: for response slot r, the position t whose logits predict it
      (``start - 1 + r``); a valid index into ``logits[:, :-1]`` (or hidden states); 0 in padded
      slots (see ``PairedContextBatch.response_mask``);
    - ``starts`` [B] long: position of the first response token; ``lengths`` [B] long: real tokens.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    gather_index: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask`` and ``position_ids`` for a forward pass."""
        return {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "position_ids": self.position_ids,
        }

    def to(self, device: torch.device | str) -> ContextBatch:
        return ContextBatch(**{k: getattr(self, k).to(device) for k in self.__dataclass_fields__})

    def rows(self, rows: slice) -> ContextBatch:
        """The batch rows ``rows`` (a micro-batch), every field sliced on its first dimension
        (subclasses' fields too: each must support ``field[rows]``)."""
        return type(self)(**{k: getattr(self, k)[rows] for k in self.__dataclass_fields__})


@dataclass(frozen=True)
class PairedContextBatch:
    """Full and residual batches over the same responses.

    ``response_ids`` [B, R] long (padded with the pad id), ``response_mask`` [B, R] bool. Gathering
    either context's log-probs at its ``gather_index`` gives a [B, R] tensor aligned with these.
    ``truncated_rows``: rows whose full or residual prompt was left-truncated to ``max_length``.
    ``teacher``: the teacher's own full and residual contexts when it scores in its own chat
    template (:class:`~saopd.contexts.TextContexts` with a teacher tokenizer), over the same
    responses (ids mapped into its vocabulary) in the same ``[B, R]`` layout and mask; None when
    both models score these contexts. :attr:`teacher_view` is what the teacher scores either way.
    """

    full: ContextBatch
    residual: ContextBatch
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    truncated_rows: tuple[int, ...]
    padding_side: str
    teacher: PairedContextBatch | None = None

    @property
    def num_truncated(self) -> int:
        return len(self.truncated_rows)

    @property
    def teacher_view(self) -> PairedContextBatch:
        """The contexts the teacher scores: :attr:`teacher` if set, else this batch."""
        return self if self.teacher is None else self.teacher

    def to(self, device: torch.device | str) -> PairedContextBatch:
        return PairedContextBatch(
            full=self.full.to(device),
            residual=self.residual.to(device),
            response_ids=self.response_ids.to(device),
            response_mask=self.response_mask.to(device),
            truncated_rows=self.truncated_rows,
            padding_side=self.padding_side,
            teacher=None if self.teacher is None else self.teacher.to(device),
        )

    def rows(self, rows: slice) -> PairedContextBatch:
        """The batch rows ``rows`` of both contexts (a micro-batch; ``truncated_rows`` is the
        whole batch's count and is not carried over)."""
        return PairedContextBatch(full=self.full.rows(rows), residual=self.residual.rows(rows),
                                  response_ids=self.response_ids[rows],
                                  response_mask=self.response_mask[rows],
                                  truncated_rows=(), padding_side=self.padding_side,
                                  teacher=None if self.teacher is None
                                  else self.teacher.rows(rows))


def resolve_pad_id(tokenizer: PreTrainedTokenizerBase | None, pad_token_id: int | None) -> int:
    if pad_token_id is not None:
        return int(pad_token_id)
    if tokenizer is not None:
        for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
            if tid is not None:
                return int(tid)
    return 0


def _truncate(
    ids: list[int], start: int, max_length: int | None, truncation: str, row: int, which: str
) -> tuple[list[int], int, bool]:
    if max_length is None or len(ids) <= max_length:
        return ids, start, False
    resp_len = len(ids) - start
    if truncation == "error":
        raise ValueError(
            f"row {row}: the {which} context has {len(ids)} tokens (prompt {start} + response "
            f"{resp_len}) > max_length {max_length}; pass truncation='truncate' to drop prompt "
            "tokens"
        )
    if resp_len + 1 > max_length:
        raise ValueError(
            f"row {row}: the response has {resp_len} tokens, so the {which} context cannot fit "
            f"max_length {max_length} (responses are never truncated; one prompt token must stay)"
        )
    cut = len(ids) - max_length
    return ids[cut:], start - cut, True


def _pad_side(
    seqs: list[list[int]],
    starts: list[int],
    resp_lens: list[int],
    *,
    pad_id: int,
    padding_side: str,
    pad_to_multiple_of: int | None,
    r_max: int,
) -> ContextBatch:
    b = len(seqs)
    t = max(len(s) for s in seqs)
    if pad_to_multiple_of:
        t = -(-t // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((b, t), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, t), dtype=torch.long)
    labels = torch.full((b, t), IGNORE_INDEX, dtype=torch.long)
    gather_index = torch.zeros((b, r_max), dtype=torch.long)
    new_starts = torch.zeros(b, dtype=torch.long)
    for i, (ids, start, r) in enumerate(zip(seqs, starts, resp_lens, strict=True)):
        off = 0 if padding_side == "right" else t - len(ids)
        input_ids[i, off : off + len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, off : off + len(ids)] = 1
        s = off + start
        labels[i, s : s + r] = input_ids[i, s : s + r]
        gather_index[i, :r] = torch.arange(s - 1, s - 1 + r)
        new_starts[i] = s
    if padding_side == "right":
        position_ids = torch.arange(t, dtype=torch.long).expand(b, t).clone()
    else:
        position_ids = attention_mask.cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
    return ContextBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        labels=labels,
        gather_index=gather_index,
        starts=new_starts,
        lengths=torch.tensor([len(s) for s in seqs], dtype=torch.long),
    )


def pad_contexts(
    contexts: Sequence[Contexts],
    *,
    pad_token_id: int,
    max_length: int | None = None,
    truncation: str = "error",
    padding_side: str = "right",
    pad_to_multiple_of: int | None = None,
) -> PairedContextBatch:
    """Pad already built :class:`Contexts` into a :class:`PairedContextBatch`.

    ``max_length`` bounds each context's length (prompt + response). Longer ones raise
    (``truncation="error"``) or lose prompt tokens from the left (``"truncate"``); the response is
    never truncated, so a response of ``max_length`` tokens or more raises either way.
    """
    check_choice("truncation", truncation, TRUNCATION_MODES)
    check_choice("padding_side", padding_side, PADDING_SIDES)
    if not contexts:
        raise ValueError("contexts is empty: nothing to collate")
    if max_length is not None and (isinstance(max_length, bool) or max_length < 2):
        raise ValueError(f"max_length must be an int >= 2 or None, got {max_length!r}")
    if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1 or None, got {pad_to_multiple_of!r}")
    full_seqs, full_starts, res_seqs, res_starts, resp_lens = [], [], [], [], []
    truncated: list[int] = []
    for i, c in enumerate(contexts):
        f_ids, f_start, f_cut = _truncate(
            c.full_ids, c.full_start, max_length, truncation, i, "full"
        )
        r_ids, r_start, r_cut = _truncate(
            c.residual_ids, c.residual_start, max_length, truncation, i, "residual"
        )
        if f_cut or r_cut:
            truncated.append(i)
        full_seqs.append(f_ids)
        full_starts.append(f_start)
        res_seqs.append(r_ids)
        res_starts.append(r_start)
        resp_lens.append(c.response_len)
    r_max = max(resp_lens)
    response_ids = torch.full((len(contexts), r_max), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((len(contexts), r_max), dtype=torch.bool)
    for i, c in enumerate(contexts):
        response_ids[i, : c.response_len] = torch.tensor(c.response_ids, dtype=torch.long)
        response_mask[i, : c.response_len] = True
    kw = {
        "pad_id": pad_token_id,
        "padding_side": padding_side,
        "pad_to_multiple_of": pad_to_multiple_of,
        "r_max": r_max,
    }
    return PairedContextBatch(
        full=_pad_side(full_seqs, full_starts, resp_lens, **kw),
        residual=_pad_side(res_seqs, res_starts, resp_lens, **kw),
        response_ids=response_ids,
        response_mask=response_mask,
        truncated_rows=tuple(truncated),
        padding_side=padding_side,
    )


def gather_response_logprobs(
    logits: torch.Tensor,
    gather_index: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probs of the response tokens, [B, R] float32 (0 where ``response_mask`` is False).

    ``logits`` [B, T, V] (or ``logits[:, :-1]``); only the ``R`` gathered rows per sequence are
    normalised (a [B, R, V] fp32 copy), so it never builds fp32 [B, T, V] log-probs. A reference
    implementation: the signals layer may chunk further.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if gather_index.shape != response_ids.shape:
        raise ValueError(
            f"gather_index {tuple(gather_index.shape)} and response_ids "
            f"{tuple(response_ids.shape)} must have the same [B, R] shape"
        )
    v = logits.shape[-1]
    rows = logits.gather(1, gather_index.unsqueeze(-1).expand(-1, -1, v)).float()
    logp = rows.log_softmax(-1).gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
    if response_mask is not None:
        logp = logp.masked_fill(~response_mask.bool(), 0.0)
    return logp
