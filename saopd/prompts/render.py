"""Chat prompts rendered to token ids by a tokenizer's chat template.

The one place a text prompt becomes ids: the prompt-length filter, the rollout engines and the
step's full contexts all call :func:`render_prompt_ids`, so what is sampled is what is scored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Message", "leading_system", "render_prompt_ids"]

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

    The template string is tokenized with ``add_special_tokens=False`` (templates write their own
    BOS), as ``apply_chat_template(tokenize=True)`` does.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{type(tokenizer).__name__} has no chat template; set tokenizer.chat_template "
            "(contexts are rendered with it)"
        )
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **dict(chat_template_kwargs or {}),
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def leading_system(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The system turns at the start of ``messages`` (copies), before the first other turn."""
    out = []
    for m in messages:
        if m.get("role") != "system":
            break
        out.append(dict(m))
    return out
