"""Schema of the training prompts (``conf/data/*.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from saopd.choices import DATA_SOURCES, LONG_PROMPT_MODES, VISION_RESIDUAL_MODES
from saopd.validation import check_choice, check_int

__all__ = ["GSM8K_INSTRUCTION", "DataConfig"]

#: The suffix verl's GSM8K preprocessing appends to each question (``data.instruction``).
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


@dataclass
class DataConfig:
    """Training prompts.

    Attributes:
        source: ``gsm8k`` (JSONL rows with ``question``/``answer``), ``prepared`` (the DVC
            pipeline's schema: ``id``, ``messages``, ``answer``; ``system_prompt`` and
            ``instruction`` do not apply, the prepared messages are used as they are) or
            ``vision`` (the same schema with image parts in the user turn, image paths relative
            to the JSONL: ``dvc repro prepare_vlm``; needs a vision-language student/teacher).
        path: the JSONL file.
        limit: use only the first ``limit`` rows.
        system_prompt: optional system turn before each question.
        instruction: text appended to each question (null = the bare question).
        skip_bad: skip malformed rows (counted) instead of stopping at the first one.
        max_prompt_length: prompts whose rendered chat template is longer are ``skip``-ped
            (counted), raise (``error``), or are left-truncated when contexts are built
            (``truncate``). With ``skip`` and ``error`` a rendering too long in characters to
            fit (:func:`saopd.prompts.text.prompt_char_limit`) is not tokenized at all; with
            ``truncate`` its text is first cut to that many characters from its end
            (:func:`saopd.prompts.text.cut_prompt_texts`).
        shuffle: shuffle the prompt order (seeded per epoch).
        residual_remove: ``source: vision`` only: what the residual context removes from the
            prompt: ``all`` (images and question, the default), ``image`` (images only) or
            ``text`` (question only, images kept).
        chat_template_kwargs: extra chat-template variables for every prompt source, in the
            prompt-length filter, rollouts and contexts alike (``{enable_thinking: false}``:
            Qwen3/Qwen3.5's non-thinking mode).
    """

    source: str = "gsm8k"
    path: str = MISSING
    limit: int | None = None
    system_prompt: str | None = None
    instruction: str | None = GSM8K_INSTRUCTION
    skip_bad: bool = False
    max_prompt_length: int | None = None
    long_prompts: str = "skip"
    shuffle: bool = True
    residual_remove: str = "all"
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_choice("source", self.source, DATA_SOURCES, owner="data")
        check_choice("residual_remove", self.residual_remove, VISION_RESIDUAL_MODES, owner="data")
        check_choice("long_prompts", self.long_prompts, LONG_PROMPT_MODES, owner="data")
        check_int("limit", self.limit, owner="data", allow_none=True)
        check_int("max_prompt_length", self.max_prompt_length, owner="data", allow_none=True)
