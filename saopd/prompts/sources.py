"""Where a run's training prompts come from (``data.source``): a registry of prompt sources.

Each source reads ``data.path`` into :class:`~saopd.prompts.text.PromptRecord` s and reports
what it read; :func:`load_prompts` then applies the prompt-length limit the same way for every
source (``data.max_prompt_length`` / ``data.long_prompts``). Registered: ``gsm8k`` (the raw
GSM8K rows), ``prepared`` (the DVC pipeline's schema) and ``vision`` (prompts with images).

Adding a source: a function ``(data: DataConfig, path: Path, processor) -> (records, report)``
decorated ``@PROMPT_SOURCES.register("<name>")`` here (or in a module this one imports), its
name in :data:`saopd.choices.DATA_SOURCES`, and a test.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from saopd.config.data import DataConfig
from saopd.prompts.text import (
    PromptRecord,
    ReadReport,
    cut_prompt_texts,
    filter_long_prompts,
    gsm8k_records,
    load_jsonl,
)
from saopd.prompts.vision import filter_long_vision_prompts, vision_records
from saopd.registry import Registry

log = logging.getLogger(__name__)

__all__ = ["PROMPT_SOURCES", "PromptSource", "load_prompts"]

#: ``(data, path, processor) -> (records, report)``: read the prompts of ``data.path``.
PromptSource = Callable[[DataConfig, Path, Any], tuple[list[PromptRecord], ReadReport]]

#: Prompt sources by ``data.source`` name.
PROMPT_SOURCES: Registry[Any] = Registry("prompt source")


@PROMPT_SOURCES.register("gsm8k")
def gsm8k_source(data: DataConfig, path: Path, processor: Any = None
                 ) -> tuple[list[PromptRecord], ReadReport]:
    """GSM8K rows (``question``, ``answer``), with ``data.system_prompt`` / ``instruction``."""
    return gsm8k_records(path, system_prompt=data.system_prompt, instruction=data.instruction,
                         limit=data.limit, skip_bad=data.skip_bad)


@PROMPT_SOURCES.register("prepared")
def prepared_source(data: DataConfig, path: Path, processor: Any = None
                    ) -> tuple[list[PromptRecord], ReadReport]:
    """Rows of the DVC pipeline's schema (``id``, ``messages``, ``answer``, ``source``), used as
    they are (``system_prompt`` and ``instruction`` do not apply)."""
    rows, report = load_jsonl(path, skip_bad=data.skip_bad)
    records = []
    for i, row in enumerate(rows, start=1):
        if not isinstance(row.get("messages"), list) or "id" not in row:
            raise ValueError(f"{path}: row {i} lacks 'id' or a 'messages' list "
                             "(expected the schema of `dvc repro prepare_train`)")
        records.append(PromptRecord(str(row["id"]), row["messages"], row.get("answer"),
                                    str(row.get("source", "prepared"))))
        if data.limit is not None and len(records) >= data.limit:
            break
    return records, report


@PROMPT_SOURCES.register("vision")
def vision_source(data: DataConfig, path: Path, processor: Any = None
                  ) -> tuple[list[PromptRecord], ReadReport]:
    """Prompts with images (image paths relative to the JSONL), checked row by row; needs the
    vision-language pair's processor."""
    if processor is None:
        raise ValueError("data.source=vision needs vision-language models (a tiny vision kind "
                         "or model.vision: true for student and teacher)")
    return vision_records(path, limit=data.limit, skip_bad=data.skip_bad)


_LOGGED_ERRORS = 20  # bad rows listed in the log one by one (all are counted)
_HINTS = {"prepared": " (run `make data` / `dvc repro prepare_train`)",
          "vision": " (run `dvc repro prepare_vlm`)"}


def load_prompts(data: DataConfig, tokenizer: Any, processor: Any = None
                 ) -> tuple[list[PromptRecord], dict[str, int]]:
    """The training prompts ``data`` describes, and counts of what was read and dropped.

    Reads ``data.path`` with the registered source ``data.source``, then drops (``skip``) or
    refuses (``error``) prompts longer than ``data.max_prompt_length`` as rendered for the
    rollout (image tokens counted for ``vision`` prompts); ``truncate`` keeps them for the engine
    and the contexts to cut, after cutting the start of any text too long in characters to fit
    (:func:`~saopd.prompts.text.cut_prompt_texts`). Counts: ``prompts_read``,
    ``rows_skipped_bad`` and, when the limit is applied here, ``prompts_skipped_long`` (skip,
    error) or ``prompts_cut_long`` (truncate).

    Raises ``ValueError`` naming the file (missing, malformed rows, nothing left) or the source.
    """
    source = PROMPT_SOURCES.get(data.source)
    path = Path(data.path)
    if path.is_dir():
        raise ValueError(f"data.path: {path} is a directory; give the JSONL file of prompts "
                         "in it")
    if not path.is_file():
        raise ValueError(f"data.path: no such file {path}{_HINTS.get(data.source, '')}")
    records, report = source(data, path, processor)
    for error in report.errors[:_LOGGED_ERRORS]:  # data.skip_bad: file:line and the reason
        log.warning("skipped: %s", error)
    if len(report.errors) > _LOGGED_ERRORS:
        log.warning("skipped %d more bad rows of %s", len(report.errors) - _LOGGED_ERRORS, path)
    counts = {"prompts_read": len(records), "rows_skipped_bad": report.skipped}
    limit = data.max_prompt_length
    if limit is not None and data.long_prompts != "truncate":
        if data.source == "vision":  # image tokens counted
            records, n_long = filter_long_vision_prompts(
                records, processor, limit, mode=data.long_prompts,
                chat_template_kwargs=data.chat_template_kwargs)
        else:
            records, n_long = filter_long_prompts(
                records, tokenizer, limit, mode=data.long_prompts,
                chat_template_kwargs=data.chat_template_kwargs)
        counts["prompts_skipped_long"] = n_long
    elif limit is not None:  # truncate: cut what no tokenizer should have to read in full
        text_tokenizer = processor.tokenizer if data.source == "vision" else tokenizer
        records, counts["prompts_cut_long"] = cut_prompt_texts(records, text_tokenizer, limit)
    if not records:
        raise ValueError(f"no training prompts left from {path} (read {counts['prompts_read']}, "
                         f"skipped {report.skipped} bad rows and "
                         f"{counts.get('prompts_skipped_long', 0)} over data.max_prompt_length)")
    return records, counts
