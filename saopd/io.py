"""Files: the project's one JSONL reader (objects with 1-based line numbers, bad lines reported
by ``file:line``) and its atomic writers (a file or a whole folder appears complete or not at
all). Plain Python (no torch), so DVC stages, evaluation and the training callbacks share it."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
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


def file_sha256(path: PathLike) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


#: Line breaks for ``str.splitlines`` that ``json.dumps(ensure_ascii=False)`` leaves raw; they
#: are escaped so that every reader sees exactly one record per line (GSM8K has U+2028).
_LINE_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def encode_json_line(record: Mapping[str, Any]) -> str:
    """One JSON line: UTF-8 text as is, except the Unicode line breaks in :data:`_LINE_BREAKS`."""
    text = json.dumps(record, ensure_ascii=False)
    for raw, escaped in _LINE_BREAKS.items():
        text = text.replace(raw, escaped)
    return text + "\n"


def swap_folder(tmp: Path, out_dir: Path) -> None:
    """Replace ``out_dir`` by the complete folder ``tmp`` (two renames; the old one is removed)."""
    old = out_dir.with_name(f".{out_dir.name}.{uuid.uuid4().hex}.old")
    if out_dir.exists():
        os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        if old.exists() and not out_dir.exists():
            os.replace(old, out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_folder(out_dir: Path) -> Iterator[Path]:
    """A new empty folder beside ``out_dir`` for a stage to write its whole output into: when the
    block ends normally it replaces ``out_dir`` (:func:`swap_folder`); when the block raises it
    is removed and ``out_dir`` is left as it was, so a stage's output is never half-written."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.{uuid.uuid4().hex}.tmp")
    tmp.mkdir()
    try:
        yield tmp
        swap_folder(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write(path: Path, chunks: Iterable[str]) -> str:
    """Write ``chunks`` to a temporary file beside ``path``, fsync it, then ``os.replace`` it onto
    ``path``. On any error the temporary file is removed and ``path`` is left as it was. The file
    gets the usual ``0o666 & ~umask`` permissions. Returns the sha256 of what was written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    h = hashlib.sha256()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            for chunk in chunks:
                data = chunk.encode("utf-8")
                h.update(data)
                fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return h.hexdigest()


def write_jsonl_atomic(path: PathLike, records: Iterable[Mapping[str, Any]]) -> str:
    """Write ``records`` as JSON lines (UTF-8, not ASCII-escaped, but U+0085/U+2028/U+2029 are
    escaped) atomically; see :func:`atomic_write`. Returns the sha256 of the file."""
    return atomic_write(Path(path), (encode_json_line(r) for r in records))


def write_json_atomic(path: PathLike, obj: Any) -> str:
    """Write ``obj`` as indented JSON atomically. Returns the sha256 of the file."""
    return atomic_write(Path(path), [json.dumps(obj, ensure_ascii=False, indent=2) + "\n"])


def build_folder_once(folder: Path, write: Callable[[Path], Any]) -> None:
    """Run ``write(tmp_dir)`` and rename ``tmp_dir`` to ``folder``; a concurrent winner is kept.

    A file lock next to ``folder`` stops two processes from doing the (slow) work twice.
    """
    from filelock import FileLock

    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if folder.exists():
            return
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
        try:
            write(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp creates 0700
            try:
                os.rename(tmp, folder)
            except OSError:
                if not folder.exists():
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
