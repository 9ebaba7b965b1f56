"""Prompts with images for vision-language models (Qwen-VL): reading, checking, rendering.

Prompt rows (JSONL, one object per line; the schema of the ``prepare_vlm`` DVC stage)::

    {"id": "count-train-0", "source": "synth_count", "answer": "3",
     "messages": [{"role": "user", "content": [
         {"type": "image", "image": "images/count-train-0.png"},
         {"type": "text", "text": "How many red circles are there? ..."}]}],
     "metadata": {"format": "count"}}

Image paths are relative to the JSONL file's folder (absolute paths are accepted too); remote or
inline images (``http(s)://``, ``data:``) are refused. :func:`read_vision_rows` checks every row
and names ``file:line`` and the message/part at fault: a missing or malformed ``messages`` list, a
role other than system/user/assistant, a conversation that does not end with a user turn, a part
that is neither ``{"type": "text", "text": str}`` nor ``{"type": "image", "image": str}``, an image
file that does not exist or that PIL cannot read. After loading, image parts hold absolute paths.

Rendering (:func:`encode_prompt`) expands each ``<|image_pad|>`` to the image's token count, so
prompt lengths, rollouts and contexts all count image tokens the same way; the step's contexts
with images are built in :mod:`saopd.contexts.vision`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from saopd.choices import LONG_PROMPT_MODES, VISION_RESIDUAL_MODES
from saopd.io import PathLike, iter_jsonl_objects
from saopd.prompts.text import PromptRecord, ReadReport, message_chars, prompt_char_limit
from saopd.validation import check_choice

if TYPE_CHECKING:
    from PIL import Image


__all__ = [
    "VISION_RESIDUAL_MODES",
    "VisionPrompt",
    "encode_prompt",
    "expand_image_tokens",
    "filter_long_vision_prompts",
    "has_images",
    "image_token_count",
    "image_token_counts",
    "load_image",
    "message_images",
    "message_parts",
    "message_text",
    "prompt_ids_from_sizes",
    "prompt_length",
    "read_vision_rows",
    "render_prompt_text",
    "validate_messages",
    "vision_records",
]

ROLES = ("system", "user", "assistant")
_REMOTE = ("http://", "https://", "data:", "file://")



# ------------------------------------------------------------------------------------ messages


def _check_part(part: Any, where: str, base_dir: Path | None, check_images: bool
                ) -> dict[str, Any]:
    if not isinstance(part, Mapping):
        raise ValueError(f"{where}: expected a part object, got {type(part).__name__}")
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}: a text part needs a string 'text' (keys: {sorted(part)})")
        return {"type": "text", "text": part["text"]}
    if kind != "image":
        raise ValueError(f"{where}: part type must be 'text' or 'image', got {kind!r}")
    ref = part.get("image")
    if not isinstance(ref, str) or not ref.strip():
        raise ValueError(f"{where}: an image part needs a non-empty path string 'image' "
                         f"(keys: {sorted(part)})")
    if ref.lower().startswith(_REMOTE):
        raise ValueError(f"{where}: image {ref[:60]!r} is remote or inline; only image files "
                         "beside the JSONL (paths relative to its folder) are supported")
    path = Path(ref)
    if not path.is_absolute():
        if base_dir is None:
            raise ValueError(f"{where}: image path {ref!r} is relative but no base folder "
                             "was given")
        path = base_dir / path
    if not path.is_file():
        raise ValueError(f"{where}: image {ref!r} not found (looked for {path})")
    if check_images:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(path) as img:
                img.verify()
        except (UnidentifiedImageError, OSError, SyntaxError) as e:
            raise ValueError(f"{where}: image {ref!r} cannot be read as an image "
                             f"({type(e).__name__}: {e})") from None
    return {"type": "image", "image": str(path.resolve())}


def validate_messages(
    messages: Any,
    *,
    base_dir: PathLike | None = None,
    where: str = "messages",
    check_images: bool = True,
) -> list[dict[str, Any]]:
    """A checked copy of a chat whose turns may hold image parts (see the module docstring).

    Image paths are resolved against ``base_dir`` and returned absolute; ``check_images`` also
    opens each image with PIL (``verify``). Raises ``ValueError`` starting with ``where`` and
    naming the message and part at fault.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of chat turns, got "
                         f"{type(messages).__name__ if messages is not None else 'nothing'}")
    base = Path(base_dir) if base_dir is not None else None
    out = []
    for i, msg in enumerate(messages):
        at = f"{where}[{i}]"
        if not isinstance(msg, Mapping):
            raise ValueError(f"{at}: expected a message object, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"{at}: role must be one of {list(ROLES)}, got {role!r}")
        content = msg.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ValueError(f"{at}: content must be a string or a list of parts, got "
                             f"{type(content).__name__}")
        parts = [_check_part(p, f"{at}.content[{j}]", base, check_images)
                 for j, p in enumerate(content)]
        if role != "user" and any(p["type"] == "image" for p in parts):
            raise ValueError(f"{at}: images are only supported in user turns (role {role!r})")
        out.append({"role": role, "content": parts})
    if out[-1]["role"] != "user":
        raise ValueError(f"{where}: the prompt must end with a user turn, got "
                         f"{out[-1]['role']!r} last")
    return out


def message_parts(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    return [dict(p) for p in content or []]


def message_images(messages: Sequence[Mapping[str, Any]]) -> list[Any]:
    """The image references (paths or PIL images) of a chat, in rendering order."""
    return [p["image"] for m in messages for p in message_parts(m) if p.get("type") == "image"]


def has_images(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any turn of the chat holds an image part."""
    return bool(message_images(messages))


def message_text(messages: Sequence[Mapping[str, Any]], image_marker: str = "[image]") -> str:
    """The last user turn as plain text, each image shown as ``image_marker`` (for views/logs)."""
    for m in reversed(messages):
        if m.get("role") == "user":
            return " ".join(p["text"] if p["type"] == "text" else image_marker
                            for p in message_parts(m)).strip()
    return ""


# ----------------------------------------------------------------------------------------- rows


def read_vision_rows(
    path: PathLike,
    *,
    limit: int | None = None,
    skip_bad: bool = False,
    check_images: bool = True,
    required: Sequence[str] = ("id", "messages"),
) -> tuple[list[dict[str, Any]], ReadReport]:
    """Rows of a prompt JSONL whose messages may hold images, each checked.

    Returns the rows (``messages`` validated by :func:`validate_messages` with image paths made
    absolute against the file's folder; other keys as read) and a :class:`ReadReport`. A bad line
    or row raises ``ValueError("<file>:<line>: ...")`` naming the field, message and part at
    fault, or is skipped and counted with ``skip_bad=True``. ``limit`` stops after that many
    good rows.
    """
    if limit is not None and (isinstance(limit, bool) or limit < 0):
        raise ValueError(f"limit must be an int >= 0 or None, got {limit!r}")
    name = os.fspath(path)
    base = Path(path).resolve().parent
    report = ReadReport(path=name)
    rows: list[dict[str, Any]] = []
    if limit == 0:
        return rows, report
    for lineno, row in iter_jsonl_objects(path, lambda msg: report.bad(msg, skip_bad)):
        where = f"{name}:{lineno}"
        missing = [k for k in required if k not in row]
        if missing:
            report.bad(f"{where}: missing field(s) {missing} (keys: {sorted(row)})", skip_bad)
            continue
        try:
            messages = validate_messages(row.get("messages"), base_dir=base,
                                         where=f"{where}: messages", check_images=check_images)
            meta = row.get("metadata", {})
            if meta is not None and not isinstance(meta, Mapping):
                raise ValueError(f"{where}: metadata must be an object, got "
                                 f"{type(meta).__name__}")
        except ValueError as e:
            report.bad(str(e), skip_bad)
            continue
        rows.append({**row, "messages": messages, "line": lineno})
        if limit is not None and len(rows) >= limit:
            break
    report.rows = len(rows)
    return rows, report


def vision_records(
    path: PathLike, *, limit: int | None = None, skip_bad: bool = False,
    check_images: bool = True,
) -> tuple[list[PromptRecord], ReadReport]:
    """:class:`PromptRecord` s of a prompt JSONL with images (:func:`read_vision_rows`); the gold
    ``answer`` as a string (None when absent), ``source`` defaulting to the file stem."""
    rows, report = read_vision_rows(path, limit=limit, skip_bad=skip_bad,
                                    check_images=check_images)
    records = [
        PromptRecord(id=str(r["id"]), messages=r["messages"],
                     answer=None if r.get("answer") is None else str(r["answer"]),
                     source=str(r.get("source") or Path(path).stem))
        for r in rows
    ]
    return records, report


# --------------------------------------------------------------------------------------- images


@functools.lru_cache(maxsize=64)
def _load_image_file(path: str, mtime_ns: int, size: int) -> Image.Image:
    from PIL import Image

    with Image.open(path) as img:
        return img.convert("RGB")


def load_image(ref: Any) -> Image.Image:
    """An RGB PIL image from a path (cached by path, modification time and size) or a PIL image."""
    from PIL import Image

    if isinstance(ref, Image.Image):
        return ref.convert("RGB")
    path = os.fspath(ref)
    try:
        st = os.stat(path)
    except OSError:
        raise FileNotFoundError(f"image {path!r} not found") from None
    return _load_image_file(path, st.st_mtime_ns, st.st_size)


# -------------------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class VisionPrompt:
    """One chat prepared by a Qwen-VL processor.

    ``ids``: the prompt token ids with every image placeholder expanded (length ``L``);
    ``pixel_values``: ``[P, D]`` float patches of the prompt's images (``P = sum_i prod(grid_i)``,
    ``D = channels * temporal_patch * patch**2``), None without images; ``image_grid_thw``:
    ``[N, 3]`` long (temporal, height, width) patch grid per image, None without images.
    """

    ids: list[int]
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    @property
    def num_images(self) -> int:
        return 0 if self.image_grid_thw is None else int(self.image_grid_thw.shape[0])

    @property
    def num_patches(self) -> int:
        return 0 if self.pixel_values is None else int(self.pixel_values.shape[0])


def _render(processor: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
            chat_template_kwargs: Mapping[str, Any] | None) -> str:
    tok = processor.tokenizer
    template = getattr(processor, "chat_template", None) or getattr(tok, "chat_template", None)
    if not template:
        raise ValueError(f"{type(processor).__name__} has no chat template")
    return tok.apply_chat_template([dict(m) for m in messages], chat_template=template,
                                   tokenize=False, add_generation_prompt=add_generation_prompt,
                                   **dict(chat_template_kwargs or {}))


def render_prompt_text(
    processor: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The chat rendered by the processor's template with the generation prompt, *before* image
    expansion (one ``<|vision_start|><|image_pad|><|vision_end|>`` per image part). This is the
    ``"prompt"`` of a vLLM multimodal request, ``{"prompt": text, "multi_modal_data": {"image":
    [load_image(r) for r in message_images(messages)]}}``; vLLM expands the placeholders itself."""
    return _render(processor, messages, True, chat_template_kwargs)


def image_token_count(processor: Any, prompt: VisionPrompt) -> int:
    """Image tokens the prompt's grids expand to: ``sum_i prod(grid_i) / merge_size**2``."""
    if prompt.image_grid_thw is None:
        return 0
    merge = int(processor.image_processor.merge_size)
    return int((prompt.image_grid_thw.prod(-1) // merge**2).sum())


def encode_prompt(
    processor: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> VisionPrompt:
    """Render ``messages`` with the processor's chat template and prepare its images.

    The text is rendered by the template (one ``<|vision_start|><|image_pad|><|vision_end|>`` per
    image part), then the processor's own ``__call__`` expands each ``<|image_pad|>`` to
    ``prod(grid_thw) / merge_size**2`` tokens and computes the pixel values; tokenization uses
    ``add_special_tokens=False`` (templates write their own special tokens), as
    :func:`saopd.contexts.text.render_prompt_ids`. Without images, the ids equal
    ``render_prompt_ids`` with the same template. Raises ``ValueError`` when the template
    renders a different number of image placeholders than the chat has images.
    """
    text = _render(processor, messages, add_generation_prompt, chat_template_kwargs)
    refs = message_images(messages)
    placeholder = getattr(processor, "image_token", "<|image_pad|>")
    found = text.count(placeholder)
    if found != len(refs):
        raise ValueError(f"the chat template rendered {found} image placeholders "
                         f"({placeholder}) for {len(refs)} image parts")
    if not refs:
        return VisionPrompt(ids=list(processor.tokenizer(text, add_special_tokens=False)
                                     ["input_ids"]))
    images = [load_image(r) for r in refs]
    enc = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
    return VisionPrompt(ids=[int(i) for i in enc["input_ids"][0].tolist()],
                        pixel_values=enc["pixel_values"],
                        image_grid_thw=enc["image_grid_thw"].long())


def _image_size(ref: Any) -> tuple[int, int]:
    """(height, width) of an image path (header only, no decoding) or PIL image."""
    from PIL import Image

    if isinstance(ref, Image.Image):
        return ref.height, ref.width
    with Image.open(os.fspath(ref)) as img:
        return img.height, img.width


def image_token_counts(processor: Any, refs: Sequence[Any]) -> list[int]:
    """How many tokens each image's ``<|image_pad|>`` expands to, from the image sizes alone
    (``get_number_of_image_patches / merge_size**2``; header reads, no pixels decoded): the
    counts :func:`encode_prompt` gets from ``image_grid_thw``."""
    ip = processor.image_processor
    merge = int(ip.merge_size)
    return [ip.get_number_of_image_patches(*_image_size(r), {}) // merge**2 for r in refs]


def expand_image_tokens(ids: Sequence[int], image_token_id: int, counts: Sequence[int]
                        ) -> list[int]:
    """``ids`` with its ``k``-th ``image_token_id`` repeated ``counts[k]`` times (what a Qwen-VL
    processor does to the rendered prompt); ``ValueError`` when the placeholder count differs
    from ``len(counts)``."""
    found = sum(1 for t in ids if t == image_token_id)
    if found != len(counts):
        raise ValueError(f"the prompt holds {found} image placeholders for {len(counts)} images")
    out: list[int] = []
    k = 0
    for t in ids:
        if t == image_token_id:
            out.extend([image_token_id] * int(counts[k]))
            k += 1
        else:
            out.append(int(t))
    return out


def prompt_ids_from_sizes(
    processor: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[int], list[int], list[Any]]:
    """``(expanded ids, unexpanded ids, image refs)`` of a chat with the generation prompt: the
    ids :func:`encode_prompt` gives, computed from the image sizes alone
    (:func:`image_token_counts`; no pixels decoded), and the same ids with one ``<|image_pad|>``
    per image (what a vLLM multimodal request takes). ``ValueError`` when the placeholder count
    differs from the chat's images."""
    text = render_prompt_text(processor, messages, chat_template_kwargs=chat_template_kwargs)
    raw = [int(t) for t in processor.tokenizer(text, add_special_tokens=False)["input_ids"]]
    refs = message_images(messages)
    image_id = processor.tokenizer.convert_tokens_to_ids(
        getattr(processor, "image_token", "<|image_pad|>"))
    return expand_image_tokens(raw, image_id, image_token_counts(processor, refs)), raw, refs


def prompt_length(
    processor: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> int:
    """Token count of ``messages`` as :func:`encode_prompt` prepares them, image tokens included,
    computed from the image sizes alone (:func:`prompt_ids_from_sizes`), so a large prompt set is
    measured quickly."""
    return len(prompt_ids_from_sizes(processor, messages,
                                     chat_template_kwargs=chat_template_kwargs)[0])


def filter_long_vision_prompts(
    records: Sequence[PromptRecord],
    processor: Any,
    max_prompt_length: int,
    mode: str = "skip",
    *,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[PromptRecord], int]:
    """:func:`saopd.prompts.text.filter_long_prompts` for chats with images: the length counts
    the expanded image tokens (:func:`prompt_length`). A prompt whose text alone is longer than
    :func:`~saopd.prompts.text.prompt_char_limit` characters (for the processor's tokenizer) is
    too long without being tokenized (image tokens only add to it). Returns
    ``(records, n_skipped)``."""
    check_choice("mode", mode, LONG_PROMPT_MODES)
    if isinstance(max_prompt_length, bool) or not isinstance(max_prompt_length, int) or \
            max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be an int >= 1, got {max_prompt_length!r}")
    char_limit = prompt_char_limit(processor.tokenizer, max_prompt_length)
    kept, too_long = [], []
    for rec in records:
        chars = message_chars(rec.messages)
        if chars > char_limit:
            too_long.append((rec.id, f"{chars:,} characters of text, not tokenized"))
            if mode == "skip":
                continue
            kept.append(rec)
            continue
        n = prompt_length(processor, rec.messages, chat_template_kwargs=chat_template_kwargs)
        if n > max_prompt_length:
            too_long.append((rec.id, n))
            if mode == "skip":
                continue
        kept.append(rec)
    if too_long and mode == "error":
        first_id, first_n = too_long[0]
        raise ValueError(f"{len(too_long)} of {len(records)} prompts exceed max_prompt_length "
                         f"{max_prompt_length} tokens with their image tokens (first: "
                         f"{first_id!r} with {first_n})")
    return kept, len(too_long) if mode == "skip" else 0
