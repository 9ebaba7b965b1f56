"""The step's contexts: full (prompt + response) and residual (task input removed + the same
response) token batches, for text and vision-language pairs (the paper's Eq. 12-13).

One interface, :class:`ContextBuilder`, with two implementations chosen once per run by
:func:`context_builder`: :class:`TextContexts` (a tokenizer and its chat template) and
:class:`~saopd.contexts.vision.VisionContexts` (a Qwen-VL processor: images expanded, pixel
values carried in the batch). The training step calls ``builder.collate(...)`` and never asks
which one it has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from saopd.config.step import StepConfig
from saopd.contexts.batch import (
    ContextBatch,
    Contexts,
    PairedContextBatch,
    gather_response_logprobs,
    pad_contexts,
    response_positions,
)
from saopd.contexts.text import (
    TextContexts,
    build_contexts,
    collate_contexts,
    residual_messages,
    residual_start_token_id,
)
from saopd.contexts.vision import VisionContexts

__all__ = [
    "ContextBatch",
    "ContextBuilder",
    "Contexts",
    "PairedContextBatch",
    "TextContexts",
    "VisionContexts",
    "build_contexts",
    "collate_contexts",
    "context_builder",
    "gather_response_logprobs",
    "pad_contexts",
    "residual_messages",
    "residual_start_token_id",
    "response_positions",
]


class ContextBuilder(Protocol):
    """How a training step turns ``B`` sampled rollouts into a :class:`PairedContextBatch`.

    ``processor`` is the pair's processor (None for text pairs) and ``chat_template_kwargs`` the
    template variables; evaluation during training renders prompts with the same two.
    """

    processor: Any
    chat_template_kwargs: dict[str, Any]

    def collate(self, messages: Sequence[Sequence[Mapping[str, Any]]],
                response_ids: Sequence[Any], *, step: StepConfig,
                prompt_ids: Sequence[Sequence[int] | None] | None = None
                ) -> PairedContextBatch:
        """``messages[b]``: row b's chat; ``response_ids[b]``: its sampled ids ``[R_b]``;
        ``prompt_ids[b]``: the exact prompt ids it was sampled from (None: render them).
        Returns right-padded full and residual contexts gathered at the same ``[B, R]``
        response tokens."""
        ...


def context_builder(tokenizer: Any, processor: Any | None = None, *,
                    residual_remove: str = "all",
                    chat_template_kwargs: Mapping[str, Any] | None = None,
                    teacher_tokenizer: Any | None = None,
                    response_id_map: Mapping[int, int] | None = None) -> ContextBuilder:
    """The builder for a pair: :class:`VisionContexts` when it has a ``processor`` (the
    residual removes ``residual_remove``: ``all`` | ``image`` | ``text``), else
    :class:`TextContexts` on ``tokenizer``. ``teacher_tokenizer`` (text pairs only): the
    teacher scores its own contexts in that tokenizer's template, with response ids mapped by
    ``response_id_map`` (:class:`TextContexts`)."""
    kwargs = dict(chat_template_kwargs or {})
    if processor is not None:
        if teacher_tokenizer is not None:
            raise ValueError("teacher-own contexts (a teacher with its own chat template) are "
                             "built for text pairs only, not vision-language pairs")
        return VisionContexts(processor, remove=residual_remove, chat_template_kwargs=kwargs)
    return TextContexts(tokenizer, chat_template_kwargs=kwargs,
                        teacher_tokenizer=teacher_tokenizer,
                        response_id_map=dict(response_id_map or {}))
