"""Full and residual contexts built from the same response token ids (SA-OPD, BASELINES.md).

For one rollout (chat ``messages`` + sampled ``response_ids``):

- full context     = chat-template prompt ids (``add_generation_prompt=True``) + response ids;
- residual context = a task-free prefix + the *identical* response ids, where the prefix is
  - ``empty_user`` (default): the template rendered with one empty user turn (``content=""``);
    the dialogue (every user/assistant/tool turn) is dropped, and the leading system turn(s) the
    caller gave are dropped unless ``keep_system=True``;
  - ``neutral_prompt``: the template with a fixed generic instruction as the user turn
    (``keep_system`` as above);
  - ``response_only``: a single start token: the tokenizer's BOS if it has one, else
    ``<|endoftext|>`` if in the vocabulary, else EOS (one token is needed so that the first
    response token has a predicting position). ``keep_system`` does not apply.

System prompts injected by the template itself (SmolLM2: "You are a helpful AI assistant named
SmolLM, trained by Hugging Face"; Qwen2.5: "You are Qwen, created by Alibaba Cloud. ...") are
input-agnostic parts of the model's chat format, so they stay in the residual context: the
residual prefix is whatever the template renders for the residual messages. A system prompt the
caller wrote is treated as part of the task input (it may carry instructions or few-shot
examples) and is dropped unless ``keep_system=True``; the template's default then appears in
its place where the template has one.

Position convention: with ``ids = prefix + response`` and ``start = len(prefix)``, the logits at
position ``start + i - 1`` predict response token ``i``. Both contexts of a row are gathered at
their own positions, giving log-probs of the same response tokens in the same ``[B, R]`` layout.

Batches (:func:`collate_contexts`) are right-padded by default: every row starts at position 0,
so models need no ``position_ids`` and no query row is fully masked. ``padding_side="left"`` is
available (as for HF ``generate``); then pass ``position_ids`` to the model. Never infer masks
from pad ids: SmolLM2's pad token is its EOS ``<|im_end|>``, which ends most responses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from saopd.choices import PADDING_SIDES, RESIDUAL_MODES, TRUNCATION_MODES
from saopd.config.step import DEFAULT_NEUTRAL_PROMPT, StepConfig
from saopd.prompts.render import Message, leading_system, render_prompt_ids
from saopd.validation import check_choice

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "ContextBatch",
    "Contexts",
    "PairedContextBatch",
    "TextContexts",
    "build_contexts",
    "check_collate_args",
    "collate_contexts",
    "gather_response_logprobs",
    "pad_contexts",
    "residual_messages",
    "residual_start_token_id",
    "response_positions",
]

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


def residual_messages(
    messages: Sequence[Message],
    residual: str = "empty_user",
    *,
    keep_system: bool = False,
    neutral_prompt: str = DEFAULT_NEUTRAL_PROMPT,
) -> list[dict[str, Any]] | None:
    """The messages rendered for the residual prefix (``None`` for ``response_only``).

    ``empty_user``: ``[leading system turns if keep_system] + [{"role": "user", "content": ""}]``;
    ``neutral_prompt``: the same with ``neutral_prompt`` as the user content.
    """
    check_choice("residual", residual, RESIDUAL_MODES)
    if residual == "response_only":
        return None
    system = leading_system(messages) if keep_system else []
    content = "" if residual == "empty_user" else neutral_prompt
    return [*system, {"role": "user", "content": content}]


def residual_start_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """Prefix token for ``response_only``: BOS, else ``<|endoftext|>`` if present, else EOS."""
    if tokenizer.bos_token_id is not None:
        return int(tokenizer.bos_token_id)
    vocab = tokenizer.get_vocab()
    if "<|endoftext|>" in vocab:
        return int(vocab["<|endoftext|>"])
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    raise ValueError(
        "response_only needs a BOS, <|endoftext|> or EOS token; the tokenizer has none"
    )


def as_id_list(response_ids: Any, row: int | None) -> list[int]:
    where = f" of row {row}" if row is not None else ""
    if isinstance(response_ids, torch.Tensor):
        if response_ids.dim() != 1 or response_ids.is_floating_point():
            raise ValueError(
                f"response_ids{where} must be a 1-D integer tensor, got shape "
                f"{tuple(response_ids.shape)} dtype {response_ids.dtype}"
            )
        ids = [int(x) for x in response_ids.tolist()]
    else:
        try:
            ids = [int(x) for x in response_ids]
        except (TypeError, ValueError):
            raise ValueError(f"response_ids{where} must be a sequence of ints") from None
    if not ids:
        raise ValueError(
            f"response_ids{where} is empty: every row needs at least one response token"
        )
    if min(ids) < 0:
        raise ValueError(f"response_ids{where} has negative ids: {[i for i in ids if i < 0][:5]}")
    return ids


def _build(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    response_ids: Any,
    *,
    residual: str,
    keep_system: bool,
    neutral_prompt: str,
    add_generation_prompt: bool,
    chat_template_kwargs: Mapping[str, Any] | None,
    row: int | None,
    prefix_cache: dict[Any, list[int]] | None = None,
    prompt_ids: Sequence[int] | None = None,
) -> Contexts:
    check_choice("residual", residual, RESIDUAL_MODES)
    where = f" of row {row}" if row is not None else ""
    if not messages:
        raise ValueError(f"messages{where} is empty")
    resp = as_id_list(response_ids, row)
    if prompt_ids is not None:  # the exact prompt the response was sampled from
        prompt = list(prompt_ids)
    else:
        prompt = render_prompt_ids(
            tokenizer,
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )
    if residual == "response_only":
        prefix = [residual_start_token_id(tokenizer)]
    else:
        res_msgs = residual_messages(
            messages, residual, keep_system=keep_system, neutral_prompt=neutral_prompt
        )
        assert res_msgs is not None
        key = repr(res_msgs)
        if prefix_cache is not None and key in prefix_cache:
            prefix = prefix_cache[key]
        else:
            prefix = render_prompt_ids(
                tokenizer,
                res_msgs,
                add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=chat_template_kwargs,
            )
            if prefix_cache is not None:
                prefix_cache[key] = prefix
    if not prompt:
        raise ValueError(f"the chat template rendered an empty prompt{where}")
    return Contexts(
        full_ids=prompt + resp,
        residual_ids=list(prefix) + resp,
        full_start=len(prompt),
        residual_start=len(prefix),
    )


def build_contexts(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    response_ids: Sequence[int] | torch.Tensor,
    *,
    residual: str = "empty_user",
    keep_system: bool = False,
    neutral_prompt: str = DEFAULT_NEUTRAL_PROMPT,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> Contexts:
    """Full and residual context ids for one response (see the module docstring).

    ``response_ids`` (length ``R >= 1``) are appended verbatim to both prefixes; they are never
    re-tokenized. ``chat_template_kwargs`` go to ``apply_chat_template`` for both contexts (e.g.
    ``enable_thinking=False`` for Qwen3). Raises ``ValueError`` for an empty response or an
    unknown ``residual`` mode (listing the allowed ones).
    """
    return _build(
        tokenizer,
        messages,
        response_ids,
        residual=residual,
        keep_system=keep_system,
        neutral_prompt=neutral_prompt,
        add_generation_prompt=add_generation_prompt,
        chat_template_kwargs=chat_template_kwargs,
        row=None,
    )


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
    """

    full: ContextBatch
    residual: ContextBatch
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    truncated_rows: tuple[int, ...]
    padding_side: str

    @property
    def num_truncated(self) -> int:
        return len(self.truncated_rows)

    def to(self, device: torch.device | str) -> PairedContextBatch:
        return PairedContextBatch(
            full=self.full.to(device),
            residual=self.residual.to(device),
            response_ids=self.response_ids.to(device),
            response_mask=self.response_mask.to(device),
            truncated_rows=self.truncated_rows,
            padding_side=self.padding_side,
        )

    def rows(self, rows: slice) -> PairedContextBatch:
        """The batch rows ``rows`` of both contexts (a micro-batch; ``truncated_rows`` is the
        whole batch's count and is not carried over)."""
        return PairedContextBatch(full=self.full.rows(rows), residual=self.residual.rows(rows),
                                  response_ids=self.response_ids[rows],
                                  response_mask=self.response_mask[rows],
                                  truncated_rows=(), padding_side=self.padding_side)


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


def check_collate_args(messages: Sequence[Any], responses: Sequence[Any],
                       prompt_ids: Sequence[Any] | None, *, residual: str,
                       truncation: str) -> None:
    """The argument checks every collate function shares (``ValueError`` naming the problem):
    known ``residual`` / ``truncation`` modes and one row of ``messages`` (and of ``prompt_ids``,
    when given) per response."""
    check_choice("residual", residual, RESIDUAL_MODES)
    check_choice("truncation", truncation, TRUNCATION_MODES)
    if len(messages) != len(responses):
        raise ValueError(f"messages has {len(messages)} rows but responses has {len(responses)}")
    if prompt_ids is not None and len(prompt_ids) != len(responses):
        raise ValueError(f"prompt_ids has {len(prompt_ids)} rows but responses has "
                         f"{len(responses)}")


def collate_contexts(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Sequence[Message]],
    responses: Sequence[Sequence[int] | torch.Tensor],
    *,
    residual: str = "empty_user",
    keep_system: bool = False,
    neutral_prompt: str = DEFAULT_NEUTRAL_PROMPT,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    max_length: int | None = None,
    truncation: str = "error",
    padding_side: str = "right",
    pad_to_multiple_of: int | None = None,
    pad_token_id: int | None = None,
    prompt_ids: Sequence[Sequence[int] | None] | None = None,
) -> PairedContextBatch:
    """Build and pad full and residual contexts for ``B`` rollouts, ready for forward passes.

    ``messages[b]`` is row b's chat (ending with the user turn), ``responses[b]`` its response ids
    (list or 1-D tensor, length ``R_b >= 1``; pass only the valid tokens, not padding). The pad id
    defaults to the tokenizer's pad, else its EOS. ``prompt_ids[b]``, when given, is the full
    context's prompt as the rollout engine saw it (e.g. left-truncated); otherwise the chat
    template is rendered. The residual prefix is always rendered from the messages. See
    :func:`build_contexts` and :func:`pad_contexts` for the options. Usage::

        batch = collate_contexts(tok, msgs, resps)
        logits = model(**batch.full.model_inputs()).logits          # [B, T_full, V]
        lp_full = gather_response_logprobs(logits, batch.full.gather_index, batch.response_ids)
        # same for batch.residual -> [B, R]; valid where batch.response_mask
    """
    check_collate_args(messages, responses, prompt_ids, residual=residual, truncation=truncation)
    cache: dict[Any, list[int]] = {}
    contexts = [
        _build(
            tokenizer,
            m,
            r,
            residual=residual,
            keep_system=keep_system,
            neutral_prompt=neutral_prompt,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
            row=i,
            prefix_cache=cache,
            prompt_ids=None if prompt_ids is None else prompt_ids[i],
        )
        for i, (m, r) in enumerate(zip(messages, responses, strict=True))
    ]
    return pad_contexts(
        contexts,
        pad_token_id=resolve_pad_id(tokenizer, pad_token_id),
        max_length=max_length,
        truncation=truncation,
        padding_side=padding_side,
        pad_to_multiple_of=pad_to_multiple_of,
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


@dataclass
class TextContexts:
    """Builds a training step's contexts for a text teacher/student pair (the
    :class:`~saopd.contexts.ContextBuilder` that :func:`~saopd.contexts.context_builder` picks
    when there is no processor).

    Attributes:
        tokenizer: the shared tokenizer, with a chat template.
        chat_template_kwargs: extra template variables, the same as the rollout engine's (e.g.
            ``{"enable_thinking": False}``), so the contexts render the prompt that was sampled.
    """

    tokenizer: Any
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    processor = None  # text pairs have no processor (VisionContexts has one)

    def collate(self, messages: Sequence[Sequence[Message]], response_ids: Sequence[Any], *,
                step: StepConfig, prompt_ids: Sequence[Sequence[int] | None] | None = None
                ) -> PairedContextBatch:
        """Full and residual contexts of ``B`` rollouts (:func:`collate_contexts`); ``step``
        gives the residual mode, ``keep_system``, the neutral prompt, ``max_length`` and the
        truncation; ``prompt_ids`` are the exact prompts the responses were sampled from."""
        return collate_contexts(
            self.tokenizer, messages, response_ids, residual=step.residual,
            keep_system=step.keep_system, neutral_prompt=step.neutral_prompt,
            max_length=step.max_length, truncation=step.truncation, prompt_ids=prompt_ids,
            chat_template_kwargs=self.chat_template_kwargs)
