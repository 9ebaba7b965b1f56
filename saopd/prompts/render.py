"""Chat prompts rendered to token ids by a tokenizer's chat template.

The one place a text prompt becomes ids: the prompt-length filter, the rollout engines and the
step's full contexts all call :func:`render_prompt_ids`, so what is sampled is what is scored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Message", "leading_system", "longest_token_chars", "render_prompt_ids",
           "render_prompt_text", "rendered_ids"]

#: One chat turn: ``{"role": ..., "content": str | list of parts}``.
Message = Mapping[str, Any]


def render_prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template.

    The template string (:func:`render_prompt_text`) is tokenized with
    ``add_special_tokens=False`` (templates write their own BOS), as
    ``apply_chat_template(tokenize=True)`` does.
    """
    return rendered_ids(tokenizer, render_prompt_text(
        tokenizer, messages, add_generation_prompt=add_generation_prompt,
        chat_template_kwargs=chat_template_kwargs))


def rendered_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of a chat-template rendering ``text`` (``add_special_tokens=False``)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_prompt_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The text of ``messages`` rendered by the tokenizer's chat template (not tokenized)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{type(tokenizer).__name__} has no chat template; set tokenizer.chat_template "
            "(contexts are rendered with it)"
        )
    return str(tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **dict(chat_template_kwargs or {}),
    ))


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """Characters of the tokenizer's longest vocabulary entry, as the vocabulary writes it.

    A byte-level entry writes one character per byte, a SentencePiece entry one per character
    (``▁`` for a space), so no token covers more characters of a text than this: a text of
    ``c`` characters has at least ``c / longest_token_chars`` tokens (up to normalisers that
    merge or drop characters)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


def leading_system(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The system turns at the start of ``messages`` (copies), before the first other turn."""
    out = []
    for m in messages:
        if m.get("role") != "system":
            break
        out.append(dict(m))
    return out
