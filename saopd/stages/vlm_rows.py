"""Rows with images for the paper's VLM stages: the :class:`Item` a converter produces, image
values to bytes, ``<image>`` placeholders to message parts, and the folder writer.

Every stage writes ``<out_dir>/<file>.jsonl`` (the vision prompt schema of
:mod:`saopd.prompts.vision`: ``messages`` whose user turn holds ``{"type": "image", "image":
"images/..."}`` parts, paths relative to the JSONL, and text parts; ``answer`` the gold answer;
``metadata``), the images as files under ``<out_dir>/images/`` and ``<out_dir>/report.json``
(rows read, eligible, sampled, written, skipped with their reasons), into a temporary folder that
is swapped in whole (:func:`write_item_folder`). Every written row is checked by
:func:`saopd.prompts.vision.validate_messages` (images opened with PIL).

Image values may be ``{"bytes": ..., "path": ...}`` dicts (what ``datasets``/parquet store), raw
bytes, PIL images, base64 strings or file paths (:func:`image_bytes`); the stored bytes are
written as they are, never re-encoded (a PIL image is saved as PNG).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from saopd.io import encode_json_line, staged_folder, write_json_atomic
from saopd.stages.common import StageReport

__all__ = [
    "Item",
    "as_list",
    "image_bytes",
    "interleave",
    "maybe_json",
    "require_text",
    "with_instruction",
    "write_item_folder",
    "write_not_prepared",
]

logger = logging.getLogger(__name__)

_PLACEHOLDER = re.compile(r"<image\s*\d*>")

_IMAGE_EXT = {"PNG": "png", "JPEG": "jpg", "GIF": "gif", "WEBP": "webp", "BMP": "bmp",
              "TIFF": "tiff", "MPO": "jpg"}


@dataclass
class Item:
    """One output row before its images are written: ``text`` (with optional placeholders),
    ``images`` (raw values), ``system`` (system turns' texts)."""

    id: str
    text: str
    images: list[Any]
    answer: str
    source: str
    metadata: dict[str, Any] = field(default_factory=dict)
    system: list[str] = field(default_factory=list)


def require_text(value: Any, what: str) -> str:
    """``value`` if it is a non-empty string, else ``ValueError`` naming ``what``."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"missing or empty {what} (need a non-empty string, got "
                         f"{type(value).__name__})")
    return value


def maybe_json(value: Any) -> Any:
    """JSON text of a list or an object parsed (columns stored as JSON strings); anything else,
    and text that is not valid JSON, as it is."""
    if isinstance(value, str) and value.strip()[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def as_list(value: Any) -> list[Any]:
    """A column value as a list: ``None`` -> ``[]``, a list/tuple as is, one value -> ``[v]``."""
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return list(value)
    return [value]


def with_instruction(text: str, instruction: str | None) -> str:
    """``text`` stripped, then a newline and ``instruction`` (none when it is empty/None)."""
    return f"{text.strip()}\n{instruction}" if instruction else text.strip()


# ------------------------------------------------------------------------------------ images


def image_bytes(value: Any, base_dir: Path | None = None) -> bytes:
    """The encoded bytes of one image value (module docstring); ``ValueError`` if none."""
    if isinstance(value, Mapping):
        if value.get("bytes"):
            return bytes(value["bytes"])
        if value.get("path"):
            return image_bytes(str(value["path"]), base_dir)
        raise ValueError(f"image dict has neither bytes nor path (keys: {sorted(value)})")
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if hasattr(value, "save") and hasattr(value, "mode"):  # a PIL image
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return buf.getvalue()
    if isinstance(value, str) and value:
        if value.startswith("data:") and "," in value:
            value = value.split(",", 1)[1]
        elif len(value) < 1024:
            path = Path(value)
            if not path.is_absolute() and base_dir is not None:
                path = base_dir / path
            if path.is_file():
                return path.read_bytes()
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"image {value[:60]!r} is neither a readable file nor base64 data"
                             ) from None
    raise ValueError(f"no image (got {type(value).__name__})")


def _image_ext(data: bytes) -> str:
    """The file extension of encoded image bytes; ``ValueError`` if PIL cannot read them."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt = img.format or "PNG"
            img.verify()
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise ValueError(f"image cannot be read ({type(e).__name__}: {e})") from None
    return _IMAGE_EXT.get(fmt, fmt.lower())


def interleave(text: str, images: Sequence[str]) -> list[dict[str, str]]:
    """User-turn parts: the text with each ``<image>`` / ``<imageN>`` placeholder replaced by
    the next image part, in order; without placeholders, the images first, then the text.
    ``ValueError`` when placeholders exist but their count differs from the images'."""
    marks = list(_PLACEHOLDER.finditer(text))
    if not marks:
        return [{"type": "image", "image": p} for p in images] + [{"type": "text", "text": text}]
    if len(marks) != len(images):
        raise ValueError(f"the text has {len(marks)} <image> placeholder(s) but the row has "
                         f"{len(images)} image(s)")
    parts: list[dict[str, str]] = []
    start = 0
    for m, img in zip(marks, images, strict=True):
        piece = text[start:m.start()].strip()
        if piece:
            parts.append({"type": "text", "text": piece})
        parts.append({"type": "image", "image": img})
        start = m.end()
    tail = text[start:].strip()
    if tail:
        parts.append({"type": "text", "text": tail})
    return parts


# ------------------------------------------------------------------------------------ output


def write_not_prepared(out_dir: Path, report: dict[str, Any]) -> dict[str, Any]:
    """``source: none``: replace ``out_dir`` by a folder holding only ``report.json``."""
    where = report["stage"]
    report = {**report, "source": "none", "prepared": False, "message": (
        f"{where}: nothing prepared (source: none). Set {where}.source to 'hub' (needs the "
        "Hugging Face hub and `pip install datasets`) or 'local' (a downloaded snapshot) in "
        "params.yaml, then `dvc repro " + where + "`.")}
    logger.warning("%s", report["message"])
    with staged_folder(out_dir) as tmp:
        write_json_atomic(tmp / "report.json", report)
    return report


def write_item_folder(out_dir: Path, groups: Mapping[str, list[tuple[str, Item]]],
                      reports: StageReport | Mapping[str, StageReport], skip_bad: bool,
                      base_dirs: Path | Mapping[str, Path | None] | None,
                      make_report: Callable[[dict[str, dict[str, Any]]], dict[str, Any]],
                      ) -> dict[str, Any]:
    """Write ``<group>.jsonl`` and ``images/`` for every group into a temporary folder beside
    ``out_dir``, check every row (:func:`saopd.prompts.vision.validate_messages`), write
    ``report.json`` (``make_report`` of the per-group sha256s and counts) and swap the folder
    in. Images go to ``images/<id>-<k>.<ext>`` (``images/<group>/`` when there are several
    groups). Bad rows go to the group's report (raise, or skip with ``skip_bad``). Returns the
    report."""
    from saopd.prompts.vision import validate_messages  # imports torch: only writing rows does

    results: dict[str, dict[str, Any]] = {}
    with staged_folder(out_dir) as tmp:
        for group, items in groups.items():
            report = reports if isinstance(reports, StageReport) else reports[group]
            base = base_dirs if not isinstance(base_dirs, Mapping) else base_dirs[group]
            sub = f"images/{group}" if len(groups) > 1 else "images"
            (tmp / sub).mkdir(parents=True, exist_ok=True)
            lines: list[str] = []
            images_sha = hashlib.sha256()
            n_images = 0
            for where, item in items:
                try:
                    rels = []
                    for k, value in enumerate(item.images):
                        data = image_bytes(value, base)
                        rel = f"{sub}/{item.id}-{k}.{_image_ext(data)}"
                        (tmp / rel).write_bytes(data)
                        rels.append(rel)
                    if not rels:
                        raise ValueError("no image")
                    messages = [{"role": "system", "content": s} for s in item.system]
                    messages.append({"role": "user", "content": interleave(item.text, rels)})
                    validate_messages(messages, base_dir=tmp, where="messages")
                except ValueError as e:
                    report.bad(f"{where}: {e}", skip_bad)
                    continue
                for rel in rels:
                    images_sha.update((tmp / rel).read_bytes())
                n_images += len(rels)
                prompt = _PLACEHOLDER.sub("", item.text).strip()
                lines.append(encode_json_line({
                    "id": item.id, "messages": messages, "prompt": prompt, "answer": item.answer,
                    "source": item.source, "metadata": item.metadata}))
            text = "".join(lines).encode("utf-8")
            (tmp / f"{group}.jsonl").write_bytes(text)
            report.rows_out = len(lines)
            results[group] = {"rows_out": len(lines), "images": n_images,
                              "jsonl_sha256": hashlib.sha256(text).hexdigest(),
                              "images_sha256": images_sha.hexdigest()}
        result = make_report(results)
        write_json_atomic(tmp / "report.json", result)
    return result

