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

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from saopd.choices import RESIDUAL_MODES, TRUNCATION_MODES
from saopd.config.step import DEFAULT_NEUTRAL_PROMPT, StepConfig
from saopd.contexts.batch import (
    Contexts,
    PairedContextBatch,
    pad_contexts,
    resolve_pad_id,
)
from saopd.prompts.render import Message, leading_system, render_prompt_ids
from saopd.validation import check_choice

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "TextContexts",
    "build_contexts",
    "check_collate_args",
    "collate_contexts",
    "residual_messages",
    "residual_start_token_id",
]


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


@dataclass
class TextContexts:
    """Builds a training step's contexts for a text teacher/student pair (the
    :class:`~saopd.contexts.ContextBuilder` that :func:`~saopd.contexts.context_builder` picks
    when there is no processor).

    Attributes:
        tokenizer: the student's tokenizer, with a chat template (rollouts were rendered by it).
        chat_template_kwargs: extra template variables, the same as the rollout engine's (e.g.
            ``{"enable_thinking": False}``), so the contexts render the prompt that was sampled;
            the teacher's template gets them too (Jinja ignores variables it does not use).
        teacher_tokenizer: set when the teacher scores in its own chat template (the run's
            ``teacher_contexts`` resolved to ``own``:
            :meth:`saopd.models.vocab.VocabularyReport.scored_contexts`): the batch then
            carries ``teacher`` contexts, the messages rendered with this tokenizer's template
            (full, and the residual with the teacher's own empty user turn) followed by the
            response ids mapped with ``response_id_map``. None = both score the student's.
        response_id_map: student id -> teacher id for response tokens (the student's EOS / end
            of turn to the teacher's, ...); ids not in it are the same token on both sides.
    """

    tokenizer: Any
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    teacher_tokenizer: Any | None = None
    response_id_map: dict[int, int] = field(default_factory=dict)

    processor = None  # text pairs have no processor (VisionContexts has one)

    def collate(self, messages: Sequence[Sequence[Message]], response_ids: Sequence[Any], *,
                step: StepConfig, prompt_ids: Sequence[Sequence[int] | None] | None = None
                ) -> PairedContextBatch:
        """Full and residual contexts of ``B`` rollouts (:func:`collate_contexts`); ``step``
        gives the residual mode, ``keep_system``, the neutral prompt, ``max_length`` and the
        truncation; ``prompt_ids`` are the exact prompts the responses were sampled from (the
        teacher's own contexts are rendered from the messages)."""
        options = {"residual": step.residual, "keep_system": step.keep_system,
                   "neutral_prompt": step.neutral_prompt, "max_length": step.max_length,
                   "truncation": step.truncation,
                   "chat_template_kwargs": self.chat_template_kwargs}
        batch = collate_contexts(self.tokenizer, messages, response_ids, prompt_ids=prompt_ids,
                                 **options)
        if self.teacher_tokenizer is None:
            return batch
        mapping = self.response_id_map
        mapped = [[mapping.get(i, i) for i in as_id_list(r, row)]
                  for row, r in enumerate(response_ids)]
        teacher = collate_contexts(self.teacher_tokenizer, messages, mapped, **options)
        return dataclasses.replace(
            batch, teacher=teacher,
            truncated_rows=tuple(sorted(set(batch.truncated_rows)
                                        | set(teacher.truncated_rows))))
