"""The project's one JSONL reader: objects with 1-based line numbers, bad lines reported by
``file:line``. Plain Python (no torch), so DVC stages can use it cheaply."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

PathLike = str | os.PathLike[str]


def iter_jsonl_objects(
    path: PathLike, on_bad: Callable[[str], None], *, name: str | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, object)`` for each non-blank line (1-based; a UTF-8 BOM is dropped).

    A line that is not valid UTF-8 or JSON, or not a JSON object, is reported as
    ``"<name>:<line>: <reason>"`` to ``on_bad`` (which raises, or counts and returns to skip it).
    The one JSONL reader of the project: prompt loading and the DVC stages both use it.
    """
    shown = name or os.fspath(path)
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                on_bad(f"{shown}:{lineno}: not valid UTF-8 ({e.reason})")
                continue
            if lineno == 1:
                text = text.removeprefix("\ufeff")
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                on_bad(f"{shown}:{lineno}: invalid JSON ({e.msg} at column {e.colno})")
                continue
            if not isinstance(obj, dict):
                on_bad(f"{shown}:{lineno}: expected a JSON object, got {type(obj).__name__}")
                continue
            yield lineno, obj
