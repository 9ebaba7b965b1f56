"""Prompts with images, and full/residual contexts for vision-language models (Qwen-VL).

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

Contexts (SA-OPD, paper Eq. 12-13). For a rollout with chat ``messages`` and response ids ``y``:

- full context = the chat rendered with its images (each ``<|image_pad|>`` expanded to
  ``prod(grid_thw) / merge**2`` tokens by the processor) + ``y``; its vision inputs are the
  images' ``pixel_values`` ``[P, D]`` and ``image_grid_thw`` ``[N, 3]``;
- residual context = a prefix with part of the task input removed + the *identical* ``y``. What is
  removed (``remove``, the ``data.residual_remove`` setting) is configurable so that researchers
  can study which part of the input grounds the teacher:

  - ``all`` (default): images and question both removed: the chat template with an empty user
    turn (``step.residual: empty_user``), no vision tokens and no pixel values; this is the
    text residual of :mod:`saopd.data.contexts`, token for token;
  - ``image``: only the images removed: the user turn keeps its text parts;
  - ``text``: only the text removed: the user turn keeps its image parts (and their vision tokens).

  The kept parts come from every non-system turn, in order, merged into one user turn; system
  turns are dropped unless ``keep_system``. ``step.residual: neutral_prompt`` puts the neutral
  instruction where text was removed; ``response_only`` is only compatible with ``all``.

Positions: the ids of both contexts are built *after* image expansion, so ``gather_index`` (the
position ``start - 1 + r`` whose logits predict response token ``r``) already counts the N image
tokens per image. Batches are right-padded and carry no ``position_ids``: the model computes its
own 3D M-RoPE positions from ``input_ids``, ``mm_token_type_ids`` and ``image_grid_thw``
(:meth:`VisionContextBatch.model_inputs`), exactly as in a plain forward pass.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from saopd.data.contexts import (
    DEFAULT_NEUTRAL_PROMPT,
    RESIDUAL_MODES,
    ContextBatch,
    Contexts,
    PairedContextBatch,
    _as_id_list,
    _check_choice,
    _leading_system,
    _pad_id,
    check_collate_args,
    pad_contexts,
    residual_start_token_id,
)
from saopd.data.jsonl import iter_jsonl_objects
from saopd.data.prompts import FILTER_MODES, PromptRecord, ReadReport

if TYPE_CHECKING:
    from PIL import Image

    from saopd.rollout.base import RolloutBatch

__all__ = [
    "VISION_RESIDUAL_MODES",
    "VisionContextBatch",
    "VisionContexts",
    "VisionInputs",
    "VisionPrompt",
    "collate_vision_contexts",
    "encode_prompt",
    "expand_image_tokens",
    "filter_long_vision_prompts",
    "has_images",
    "image_token_counts",
    "load_image",
    "message_images",
    "message_text",
    "prompt_ids_from_sizes",
    "prompt_length",
    "read_vision_rows",
    "render_prompt_text",
    "validate_messages",
    "vision_records",
    "vision_residual_messages",
]

VISION_RESIDUAL_MODES = ("all", "image", "text")
ROLES = ("system", "user", "assistant")
_REMOTE = ("http://", "https://", "data:", "file://")

PathLike = str | os.PathLike[str]


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


def _parts(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    return [dict(p) for p in content or []]


def message_images(messages: Sequence[Mapping[str, Any]]) -> list[Any]:
    """The image references (paths or PIL images) of a chat, in rendering order."""
    return [p["image"] for m in messages for p in _parts(m) if p.get("type") == "image"]


def has_images(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any turn of the chat holds an image part."""
    return bool(message_images(messages))


def message_text(messages: Sequence[Mapping[str, Any]], image_marker: str = "[image]") -> str:
    """The last user turn as plain text, each image shown as ``image_marker`` (for views/logs)."""
    for m in reversed(messages):
        if m.get("role") == "user":
            return " ".join(p["text"] if p["type"] == "text" else image_marker
                            for p in _parts(m)).strip()
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
    for lineno, row in iter_jsonl_objects(path, lambda msg: report._bad(msg, skip_bad)):
        where = f"{name}:{lineno}"
        missing = [k for k in required if k not in row]
        if missing:
            report._bad(f"{where}: missing field(s) {missing} (keys: {sorted(row)})", skip_bad)
            continue
        try:
            messages = validate_messages(row.get("messages"), base_dir=base,
                                         where=f"{where}: messages", check_images=check_images)
            meta = row.get("metadata", {})
            if meta is not None and not isinstance(meta, Mapping):
                raise ValueError(f"{where}: metadata must be an object, got "
                                 f"{type(meta).__name__}")
        except ValueError as e:
            report._bad(str(e), skip_bad)
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
    :func:`saopd.data.contexts.render_prompt_ids`. Without images, the ids equal
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
    """:func:`saopd.data.prompts.filter_long_prompts` for chats with images: the length counts
    the expanded image tokens (:func:`prompt_length`). Returns ``(records, n_skipped)``."""
    _check_choice("mode", mode, FILTER_MODES)
    if isinstance(max_prompt_length, bool) or not isinstance(max_prompt_length, int) or \
            max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be an int >= 1, got {max_prompt_length!r}")
    kept, too_long = [], []
    for rec in records:
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


# ------------------------------------------------------------------------------------- residual


def vision_residual_messages(
    messages: Sequence[Mapping[str, Any]],
    remove: str = "all",
    *,
    residual: str = "empty_user",
    keep_system: bool = False,
    neutral_prompt: str = DEFAULT_NEUTRAL_PROMPT,
) -> list[dict[str, Any]] | None:
    """The messages rendered for a VLM residual prefix (``None`` for ``response_only``).

    ``remove``: ``all`` (images and text: an empty user turn, or ``neutral_prompt``), ``image``
    (the user turn keeps the text parts of every non-system turn) or ``text`` (it keeps their image
    parts; with ``residual="neutral_prompt"`` the neutral instruction follows them). Leading system
    turns are kept only with ``keep_system``. Raises ``ValueError`` for an unknown mode, or
    ``response_only`` with ``remove`` other than ``all``.
    """
    _check_choice("remove", remove, VISION_RESIDUAL_MODES)
    _check_choice("residual", residual, RESIDUAL_MODES)
    if residual == "response_only":
        if remove != "all":
            raise ValueError(f"residual='response_only' keeps no prompt at all, so it cannot "
                             f"keep the {'text' if remove == 'image' else 'images'} "
                             f"(remove={remove!r}); use residual='empty_user'")
        return None
    system = _leading_system(messages) if keep_system else []
    body = [p for m in messages if m.get("role") != "system" for p in _parts(m)]
    neutral = [{"type": "text", "text": neutral_prompt}] if residual == "neutral_prompt" else []
    if remove == "all":
        kept: list[dict[str, Any]] = neutral
    elif remove == "image":
        kept = [p for p in body if p["type"] == "text"] or neutral
    else:
        kept = [p for p in body if p["type"] == "image"] + neutral
    content: Any = kept if kept else ""
    if kept and all(p["type"] == "text" for p in kept):  # plain text renders as in contexts.py
        content = "".join(p["text"] for p in kept)
    return [*system, {"role": "user", "content": content}]


# ---------------------------------------------------------------------------------------- batch


@dataclass(frozen=True)
class VisionInputs:
    """The images of a batch, concatenated in row order, and how they split into rows.

    - ``pixel_values`` ``[P, D]`` float: every row's patches, row after row (``[0, 0]`` when the
      batch has no images);
    - ``image_grid_thw`` ``[N, 3]`` long: one (t, h, w) patch grid per image, row after row;
    - ``images_per_row`` ``[B]`` long and ``patches_per_row`` ``[B]`` long.

    ``inputs[rows]`` (a slice of rows) returns the images of those rows, so a
    :class:`VisionContextBatch` can be split into micro-batches like any ``ContextBatch``.
    """

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    images_per_row: torch.Tensor
    patches_per_row: torch.Tensor

    @classmethod
    def from_prompts(cls, prompts: Sequence[VisionPrompt | None]) -> VisionInputs:
        with_images = [p for p in prompts if p is not None and p.num_images]
        pixels = (torch.cat([p.pixel_values for p in with_images]) if with_images  # type: ignore[misc]
                  else torch.zeros(0, 0))
        grids = (torch.cat([p.image_grid_thw for p in with_images]) if with_images  # type: ignore[misc]
                 else torch.zeros(0, 3, dtype=torch.long))
        counts = [0 if p is None else p.num_images for p in prompts]
        patches = [0 if p is None else p.num_patches for p in prompts]
        return cls(pixels, grids, torch.tensor(counts, dtype=torch.long),
                   torch.tensor(patches, dtype=torch.long))

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    def __getitem__(self, rows: slice) -> VisionInputs:
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"VisionInputs can only be sliced by contiguous rows, got {rows!r}")
        start, stop, _ = rows.indices(len(self.images_per_row))
        stop = max(start, stop)
        img = torch.cat([torch.zeros(1, dtype=torch.long), self.images_per_row.cumsum(0)])
        pat = torch.cat([torch.zeros(1, dtype=torch.long), self.patches_per_row.cumsum(0)])
        i0, i1, p0, p1 = int(img[start]), int(img[stop]), int(pat[start]), int(pat[stop])
        pixels = self.pixel_values[p0:p1] if i1 > i0 else self.pixel_values[:0]
        return VisionInputs(pixels, self.image_grid_thw[i0:i1], self.images_per_row[rows],
                            self.patches_per_row[rows])

    def to(self, device: torch.device | str) -> VisionInputs:
        return VisionInputs(*(getattr(self, f.name).to(device) for f in fields(self)))

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """``pixel_values`` and ``image_grid_thw`` when the batch has images, else nothing."""
        if not self.num_images:
            return {}
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}


@dataclass(frozen=True)
class VisionContextBatch(ContextBatch):
    """A :class:`~saopd.data.contexts.ContextBatch` (right-padded) whose rows may hold images.

    Extra fields: ``mm_token_type_ids`` ``[B, T]`` long (1 at image tokens, 2 at video tokens, 0
    elsewhere) and ``vision`` (:class:`VisionInputs`). ``gather_index`` ``[B, R]`` counts the
    expanded image tokens. :meth:`model_inputs` leaves out ``position_ids`` so that the model
    builds its own 3D M-RoPE positions (text positions continue after each image at
    ``max(h, w) / merge`` past its start, not at its token count).
    """

    mm_token_type_ids: torch.Tensor
    vision: VisionInputs

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask``, ``mm_token_type_ids`` (+ ``pixel_values``,
        ``image_grid_thw`` when the batch has images) for ``model(...)`` / ``model.model(...)``."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask,
                "mm_token_type_ids": self.mm_token_type_ids, **self.vision.model_inputs()}

    def to(self, device: torch.device | str) -> VisionContextBatch:
        return VisionContextBatch(**{f.name: getattr(self, f.name).to(device)
                                     for f in fields(self)})


def _token_types(input_ids: torch.Tensor, ids: Mapping[str, int | None]) -> torch.Tensor:
    types = torch.zeros_like(input_ids)
    if ids.get("image") is not None:
        types[input_ids == ids["image"]] = 1
    if ids.get("video") is not None:
        types[input_ids == ids["video"]] = 2
    return types


def _check_cut(ids: list[int], start: int, max_length: int | None, vision: frozenset[int],
               row: int, which: str) -> None:
    """Left truncation must not cut an image: its pixel values would no longer match."""
    if max_length is None or len(ids) <= max_length:
        return
    cut = len(ids) - max_length
    if cut <= start and any(t in vision for t in ids[:cut]):
        raise ValueError(
            f"row {row}: the {which} context has {len(ids)} tokens > max_length {max_length}, "
            f"and cutting {cut} prompt tokens from the left would cut into an image (image "
            "tokens cannot be truncated); raise step.max_length or lower the images' max_pixels"
        )


def collate_vision_contexts(
    processor: Any,
    messages: Sequence[Sequence[Mapping[str, Any]]],
    responses: Sequence[Sequence[int] | torch.Tensor],
    *,
    remove: str = "all",
    residual: str = "empty_user",
    keep_system: bool = False,
    neutral_prompt: str = DEFAULT_NEUTRAL_PROMPT,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    max_length: int | None = None,
    truncation: str = "error",
    pad_to_multiple_of: int | None = None,
    pad_token_id: int | None = None,
    prompt_ids: Sequence[Sequence[int] | None] | None = None,
) -> PairedContextBatch:
    """Full and residual contexts of ``B`` rollouts whose prompts may hold images.

    ``messages[b]``: row b's chat (validated, image parts holding paths or PIL images);
    ``responses[b]``: its ``R_b >= 1`` response ids, appended verbatim to both prefixes.
    ``prompt_ids[b]``: the expanded prompt the rollout engine sampled from (its image token count
    is checked against the row's images); otherwise the chat is rendered. Returns a
    :class:`~saopd.data.contexts.PairedContextBatch` whose ``full`` and ``residual`` are
    :class:`VisionContextBatch` es, right-padded; ``response_ids`` / ``response_mask`` ``[B, R]``.
    ``remove`` picks the residual (module docstring); the other options are those of
    :func:`saopd.data.contexts.collate_contexts`. Usage::

        batch = collate_vision_contexts(processor, msgs, resps, remove="all")
        hidden = model.model(**batch.full.model_inputs()).last_hidden_state   # [B, T, H]
        # gather at batch.full.gather_index [B, R] -> the response positions
    """
    _check_choice("remove", remove, VISION_RESIDUAL_MODES)
    check_collate_args(messages, responses, prompt_ids, residual=residual, truncation=truncation)
    from saopd.models.vlm import vision_special_ids, vision_token_ids

    tok_ids = vision_token_ids(processor)
    vision_set = vision_special_ids(processor)
    cache: dict[str, VisionPrompt] = {}

    def encode(msgs: Sequence[Mapping[str, Any]]) -> VisionPrompt:
        key = repr([dict(m) for m in msgs])  # paths are strings, so the repr identifies a chat
        if key not in cache:
            cache[key] = encode_prompt(processor, msgs, chat_template_kwargs=chat_template_kwargs)
        return cache[key]

    contexts, full_prompts, res_prompts = [], [], []
    for i, (msgs, resp) in enumerate(zip(messages, responses, strict=True)):
        if not msgs:
            raise ValueError(f"messages of row {i} is empty")
        ids_resp = _as_id_list(resp, i)
        in_response = sorted(vision_set.intersection(ids_resp))
        if in_response:
            raise ValueError(f"row {i}: the response holds vision special token ids "
                             f"{in_response} (a response cannot hold images; the rollout engines "
                             "suppress them)")
        full = encode(msgs)
        prompt = full.ids
        if prompt_ids is not None and prompt_ids[i] is not None:
            prompt = [int(t) for t in prompt_ids[i]]  # type: ignore[union-attr]
            have = sum(t == tok_ids["image"] for t in prompt)
            want = image_token_count(processor, full)
            if have != want:
                raise ValueError(f"row {i}: the rollout's prompt has {have} image tokens but "
                                 f"its {full.num_images} image(s) expand to {want}")
        res_msgs = vision_residual_messages(msgs, remove, residual=residual,
                                            keep_system=keep_system, neutral_prompt=neutral_prompt)
        if res_msgs is None:
            res = VisionPrompt(ids=[residual_start_token_id(processor.tokenizer)])
        else:
            res = encode(res_msgs)
        c = Contexts(full_ids=prompt + ids_resp, residual_ids=res.ids + ids_resp,
                     full_start=len(prompt), residual_start=len(res.ids))
        _check_cut(c.full_ids, c.full_start, max_length, vision_set, i, "full")
        _check_cut(c.residual_ids, c.residual_start, max_length, vision_set, i, "residual")
        contexts.append(c)
        full_prompts.append(full)
        res_prompts.append(res)
    base = pad_contexts(contexts, pad_token_id=_pad_id(processor.tokenizer, pad_token_id),
                        max_length=max_length, truncation=truncation, padding_side="right",
                        pad_to_multiple_of=pad_to_multiple_of)

    def wrap(ctx: ContextBatch, prompts: list[VisionPrompt]) -> VisionContextBatch:
        return VisionContextBatch(**{f.name: getattr(ctx, f.name) for f in fields(ContextBatch)},
                                  mm_token_type_ids=_token_types(ctx.input_ids, tok_ids),
                                  vision=VisionInputs.from_prompts(prompts))

    return PairedContextBatch(full=wrap(base.full, full_prompts),
                              residual=wrap(base.residual, res_prompts),
                              response_ids=base.response_ids, response_mask=base.response_mask,
                              truncated_rows=base.truncated_rows, padding_side="right")


@dataclass
class VisionContexts:
    """Builds a training step's contexts for a VLM (what ``OPDModule.build_contexts`` calls when
    the prompts may hold images).

    Attributes:
        processor: the student's processor (checked equal to the teacher's at start-up).
        remove: what the residual context removes: ``all`` | ``image`` | ``text``.
        chat_template_kwargs: extra template variables (``{"enable_thinking": False}`` for the
            non-thinking mode of Qwen3.5), the same as the rollout engine's.
    """

    processor: Any
    remove: str = "all"
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_choice("remove", self.remove, VISION_RESIDUAL_MODES)

    def collate(self, rollouts: RolloutBatch, step: Any) -> PairedContextBatch:
        """Contexts of ``rollouts``; ``step`` is the module's ``StepConfig`` (residual,
        keep_system, neutral_prompt, max_length, truncation)."""
        return collate_vision_contexts(
            self.processor, rollouts.row_messages(), [r.response_ids for r in rollouts.rollouts],
            remove=self.remove, residual=step.residual, keep_system=step.keep_system,
            neutral_prompt=step.neutral_prompt, chat_template_kwargs=self.chat_template_kwargs,
            max_length=step.max_length, truncation=step.truncation,
            prompt_ids=[r.prompt_ids for r in rollouts.rollouts],
        )
