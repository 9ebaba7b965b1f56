"""Full and residual contexts for vision-language models (Qwen-VL).

Contexts (SA-OPD, paper Eq. 12-13). For a rollout with chat ``messages`` and response ids ``y``:

- full context = the chat rendered with its images (each ``<|image_pad|>`` expanded to
  ``prod(grid_thw) / merge**2`` tokens by the processor) + ``y``; its vision inputs are the
  images' ``pixel_values`` ``[P, D]`` and ``image_grid_thw`` ``[N, 3]``;
- residual context = a prefix with part of the task input removed + the *identical* ``y``. What is
  removed (``remove``, the ``data.residual_remove`` setting) is configurable so that researchers
  can study which part of the input grounds the teacher:

  - ``all`` (default): images and question both removed: the chat template with an empty user
    turn (``step.residual: empty_user``), no vision tokens and no pixel values; this is the
    text residual of :mod:`saopd.contexts.text`, token for token;
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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from saopd.choices import RESIDUAL_MODES, VISION_RESIDUAL_MODES
from saopd.config.step import DEFAULT_NEUTRAL_PROMPT, StepConfig
from saopd.contexts.batch import (
    ContextBatch,
    Contexts,
    PairedContextBatch,
    pad_contexts,
    resolve_pad_id,
)
from saopd.contexts.text import as_id_list, check_collate_args, residual_start_token_id
from saopd.models.vlm import vision_special_ids, vision_token_ids
from saopd.prompts.render import leading_system
from saopd.prompts.vision import VisionPrompt, encode_prompt, image_token_count, message_parts
from saopd.validation import check_choice

__all__ = [
    "VisionContextBatch",
    "VisionContexts",
    "VisionInputs",
    "collate_vision_contexts",
    "vision_residual_messages",
]


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
    check_choice("remove", remove, VISION_RESIDUAL_MODES)
    check_choice("residual", residual, RESIDUAL_MODES)
    if residual == "response_only":
        if remove != "all":
            raise ValueError(f"residual='response_only' keeps no prompt at all, so it cannot "
                             f"keep the {'text' if remove == 'image' else 'images'} "
                             f"(remove={remove!r}); use residual='empty_user'")
        return None
    system = leading_system(messages) if keep_system else []
    body = [p for m in messages if m.get("role") != "system" for p in message_parts(m)]
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
    """A :class:`~saopd.contexts.text.ContextBatch` (right-padded) whose rows may hold images.

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
    :class:`~saopd.contexts.text.PairedContextBatch` whose ``full`` and ``residual`` are
    :class:`VisionContextBatch` es, right-padded; ``response_ids`` / ``response_mask`` ``[B, R]``.
    ``remove`` picks the residual (module docstring); the other options are those of
    :func:`saopd.contexts.text.collate_contexts`. Usage::

        batch = collate_vision_contexts(processor, msgs, resps, remove="all")
        hidden = model.model(**batch.full.model_inputs()).last_hidden_state   # [B, T, H]
        # gather at batch.full.gather_index [B, R] -> the response positions
    """
    check_choice("remove", remove, VISION_RESIDUAL_MODES)
    check_collate_args(messages, responses, prompt_ids, residual=residual, truncation=truncation)

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
        ids_resp = as_id_list(resp, i)
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
    base = pad_contexts(contexts, pad_token_id=resolve_pad_id(processor.tokenizer, pad_token_id),
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
    """Builds a training step's contexts for a vision-language pair (the
    :class:`~saopd.contexts.ContextBuilder` that :func:`~saopd.contexts.context_builder` picks
    when the pair has a processor: prompts may hold images).

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
        check_choice("remove", self.remove, VISION_RESIDUAL_MODES)

    def collate(self, messages: Sequence[Sequence[Mapping[str, Any]]],
                response_ids: Sequence[Any], *, step: StepConfig,
                prompt_ids: Sequence[Sequence[int] | None] | None = None) -> PairedContextBatch:
        """Contexts of ``B`` rollouts (:func:`collate_vision_contexts`); ``step`` gives the
        residual mode, ``keep_system``, the neutral prompt, ``max_length`` and the truncation."""
        return collate_vision_contexts(
            self.processor, messages, response_ids, remove=self.remove, residual=step.residual,
            keep_system=step.keep_system, neutral_prompt=step.neutral_prompt,
            chat_template_kwargs=self.chat_template_kwargs, max_length=step.max_length,
            truncation=step.truncation, prompt_ids=prompt_ids,
        )
