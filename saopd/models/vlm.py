"""Vision-language models (Qwen-VL families): loading, PIL-only processors, tiny random models and
the teacher/student processor check.

Supported families (``config.model_type``): ``qwen2_vl`` (Qwen2-VL), ``qwen2_5_vl`` (Qwen2.5-VL),
``qwen3_vl`` / ``qwen3_vl_moe`` (Qwen3-VL) and ``qwen3_5`` / ``qwen3_5_moe`` (Qwen3.5, the paper's
VLM setups: Qwen3.5-35B-A3B -> Qwen3.5-2B). All of them:

- load with ``AutoModelForImageTextToText`` (the ``...ForConditionalGeneration`` class);
- expand each ``<|image_pad|>`` of the rendered chat to ``prod(image_grid_thw) / merge_size**2``
  tokens (one per merged ``merge_size x merge_size`` block of ``patch_size`` pixel patches);
- take ``pixel_values`` ``[num_patches, C * temporal_patch_size * patch_size**2]``,
  ``image_grid_thw`` ``[num_images, 3]`` and ``mm_token_type_ids`` ``[B, T]`` (0 text, 1 image,
  2 video), from which the model computes its own 3D (M-RoPE) positions.

Processors are always built with the PIL image processor (``Qwen2VLImageProcessorPil``) and
without a video processor: ``AutoProcessor`` would load the torchvision-based fast image and video
processors, and torchvision is not available on CPU machines here (``DESIGN.md``). The same PIL
path on GPU machines keeps pixel values identical across machines. Videos are not supported.

The student's processor prepares every prompt, and the *same* ids and pixel values are fed to the
teacher, so the two processors must agree on everything that shapes those inputs:
:func:`check_same_processor` refuses a pair that differs (image/vision token ids, patch, temporal
patch and merge sizes, pixel limits, normalisation, the rendered chat of a probe conversation) and
a model whose config disagrees with its processor (``image_token_id``, patch/merge sizes).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from saopd.models.loading import (
    from_pretrained,
    load_pretrained_model,
    load_tokenizer,
    resolve_source,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.processing_utils import ProcessorMixin

__all__ = [
    "QWEN_VL_CHAT_TEMPLATE",
    "VISION_SPECIAL_TOKENS",
    "VLM_FAMILIES",
    "ProcessorReport",
    "check_engine_processor",
    "check_model_matches_processor",
    "check_same_processor",
    "image_only_processor",
    "load_vlm",
    "load_vlm_processor",
    "pil_image_processor",
    "pixel_kwargs",
    "save_processor_for_vllm",
    "vision_special_ids",
    "vision_token_ids",
]

#: model_type -> transformers processor class name (image inputs only, see the module docstring).
VLM_FAMILIES: dict[str, str] = {
    "qwen2_vl": "Qwen2VLProcessor",
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
    "qwen3_vl_moe": "Qwen3VLProcessor",
    "qwen3_5": "Qwen3VLProcessor",
    "qwen3_5_moe": "Qwen3VLProcessor",
}
#: model_type -> transformers video processor class name (what vLLM's processors load; see
#: :func:`save_processor_for_vllm`).
VIDEO_PROCESSORS: dict[str, str] = {
    "qwen2_vl": "Qwen2VLVideoProcessor",
    "qwen2_5_vl": "Qwen2VLVideoProcessor",
    "qwen3_vl": "Qwen3VLVideoProcessor",
    "qwen3_vl_moe": "Qwen3VLVideoProcessor",
    "qwen3_5": "Qwen3VLVideoProcessor",
    "qwen3_5_moe": "Qwen3VLVideoProcessor",
}
#: Qwen's vision special tokens (the tiny tokenizer gets them appended; Qwen's has them).
VISION_SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# A Qwen3-VL / Qwen3.5-style ChatML template written for this project: no default system prompt,
# each image part as <|vision_start|><|image_pad|><|vision_end|> where it stands in the content,
# text parts verbatim; enable_thinking=False adds the empty think block of the hybrid templates.
QWEN_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' or 'image' in part %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)

_PROBE_MESSAGES = [
    {"role": "system", "content": "probe system"},
    {"role": "user", "content": [{"type": "image", "image": "probe.png"},
                                 {"type": "text", "text": "What is shown?"}]},
]


# --------------------------------------------------------------------------------------------------
# processors


@functools.cache
def image_only_processor(family_class: str) -> type:
    """A subclass of the transformers processor ``family_class`` taking only an image processor
    and a tokenizer (no video processor, so no torchvision).

    Its ``__call__(text=..., images=...)`` is the family's own: ``<|image_pad|>`` expanded to
    ``prod(image_grid_thw) // merge_size**2`` tokens per image, ``mm_token_type_ids`` returned.
    """
    import transformers
    from transformers.processing_utils import ProcessorMixin

    base = getattr(transformers, family_class)

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        self.vision_start_token = "<|vision_start|>"
        self.vision_end_token = "<|vision_end|>"
        self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
        self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return type(f"{family_class}ImageOnly", (base,), {"__init__": __init__,
                                                       "__module__": __name__})


def vision_token_ids(processor: Any) -> dict[str, int | None]:
    """``image``, ``video``, ``vision_start`` and ``vision_end`` token ids of a processor's
    tokenizer (None where the token is not in the vocabulary)."""
    tok = processor.tokenizer
    vocab = tok.get_vocab()
    names = {"image": getattr(processor, "image_token", "<|image_pad|>"),
             "video": getattr(processor, "video_token", "<|video_pad|>"),
             "vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>"}
    return {k: vocab.get(v) for k, v in names.items()}


def vision_special_ids(processor: Any) -> frozenset[int]:
    """The ids of :func:`vision_token_ids` that the vocabulary has: what left truncation must not
    cut (an image cannot be cut in part) and what a response may not hold."""
    return frozenset(t for t in vision_token_ids(processor).values() if t is not None)


def check_engine_processor(processor: Any, tokenizer: Any, owner: str) -> None:
    """A rollout engine's processor check: ``ValueError`` (naming ``owner``) unless
    ``processor`` is a Qwen-VL processor (has an image processor) whose tokenizer is the
    engine's ``tokenizer`` itself."""
    if getattr(processor, "tokenizer", None) is not tokenizer:
        raise ValueError(f"{owner}: the processor's tokenizer must be the engine's tokenizer "
                         "(pass processor.tokenizer as tokenizer)")
    if getattr(processor, "image_processor", None) is None:
        raise ValueError(f"{owner}: {type(processor).__name__} has no image processor "
                         "(expected a Qwen-VL processor)")


def pil_image_processor(**kwargs: Any) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(**kwargs)


def pixel_kwargs(min_pixels: int | None, max_pixels: int | None) -> dict[str, int]:
    out = {}
    for name, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be null or an int >= 1, got {value!r}")
            out[name] = value
    if min_pixels is not None and max_pixels is not None and min_pixels > max_pixels:
        raise ValueError(f"min_pixels ({min_pixels}) must be <= max_pixels ({max_pixels})")
    return out


def load_vlm_processor(
    name_or_path: str | os.PathLike,
    *,
    trust_remote_code: bool = False,
    revision: str | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> ProcessorMixin:
    """The processor of a Qwen-VL checkpoint (local folder or hub id), PIL image processor only.

    The family comes from the checkpoint's ``config.json`` (:data:`VLM_FAMILIES`); the image
    processor settings from its ``preprocessor_config.json`` (``min_pixels`` / ``max_pixels``
    override the stored pixel limits); the chat template from the processor's
    ``chat_template.jinja`` / ``chat_template.json``, else the tokenizer's. Raises ``ValueError``
    for an unsupported family, :class:`~saopd.models.loading.HubUnavailableError` when the hub is
    needed but unreachable.
    """
    from transformers import AutoConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )


    source = resolve_source(name_or_path, None, kind="model")
    config = from_pretrained(AutoConfig, source, ("config.json",), revision,
                              trust_remote_code=trust_remote_code)
    family = VLM_FAMILIES.get(config.model_type)
    if family is None:
        raise ValueError(
            f"{os.fspath(name_or_path)!r} is a {config.model_type!r} model; vision-language "
            f"training supports the Qwen-VL families {sorted(VLM_FAMILIES)}"
        )
    tokenizer = load_tokenizer(name_or_path, trust_remote_code=trust_remote_code,
                               revision=revision)
    image_processor = from_pretrained(
        Qwen2VLImageProcessorPil, source, ("preprocessor_config.json",), revision,
        **pixel_kwargs(min_pixels, max_pixels),
    )
    cls = image_only_processor(family)
    template = None
    try:
        processor_dict, _ = cls.get_processor_dict(source.location, revision=revision)
        template = processor_dict.get("chat_template")
    except (OSError, ValueError):  # no processor files: the tokenizer's template is used
        pass
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(f"{os.fspath(name_or_path)!r} has no chat template (neither the "
                         "processor's chat_template.jinja/json nor the tokenizer's)")
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)


def load_vlm(name_or_path: str | os.PathLike, *, dtype: str | torch.dtype = "float32",
             trust_remote_code: bool = False, revision: str | None = None) -> PreTrainedModel:
    """A Qwen-VL model (eval mode) via ``AutoModelForImageTextToText`` from a folder or hub id."""
    from transformers import AutoModelForImageTextToText

    model = load_pretrained_model(AutoModelForImageTextToText, name_or_path, dtype=dtype,
                                  trust_remote_code=trust_remote_code, revision=revision)
    family = getattr(model.config, "model_type", None)
    if family not in VLM_FAMILIES:
        raise ValueError(f"{os.fspath(name_or_path)!r} loaded as {type(model).__name__} "
                         f"({family!r}); supported VLM families: {sorted(VLM_FAMILIES)}")
    return model.eval()


def save_processor_for_vllm(processor: Any, folder: str | os.PathLike, model_type: str) -> None:
    """Save ``processor`` to ``folder`` so that vLLM builds the *same* image preprocessing.

    vLLM loads the family's full processor (``Qwen2VLProcessor`` / ``Qwen3VLProcessor``), which
    needs a video processor too; saopd's processors are image-only (no torchvision here). This
    writes the processor files (``processor.save_pretrained``: tokenizer, chat template, image
    processor settings), then rewrites ``processor_config.json`` with the family's processor
    class and a ``video_processor`` entry whose patch, temporal patch and merge sizes, pixel
    limits and normalisation are the image processor's (videos are never sent: the engine sets
    vLLM's video limit to 0). vLLM then expands each ``<|image_pad|>`` to the same number of
    tokens as :func:`saopd.prompts.vision.encode_prompt` (the engine checks this on every prompt).

    Raises ``ValueError`` for a model type outside :data:`VLM_FAMILIES`.
    """
    import json

    if model_type not in VLM_FAMILIES:
        raise ValueError(f"save_processor_for_vllm: {model_type!r} is not a supported VLM family "
                         f"{sorted(VLM_FAMILIES)}")
    folder = os.fspath(folder)
    processor.save_pretrained(folder)
    path = os.path.join(folder, "processor_config.json")
    with open(path) as f:
        config = json.load(f)
    image = dict(config.get("image_processor") or processor.image_processor.to_dict())
    config["processor_class"] = VLM_FAMILIES[model_type]
    config["video_processor"] = {
        "video_processor_type": VIDEO_PROCESSORS[model_type],
        **{k: image[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "size",
                                 "image_mean", "image_std", "do_resize", "do_rescale",
                                 "rescale_factor", "do_normalize", "do_convert_rgb")
           if k in image},
    }
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(config, f, indent=2)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------
# tiny offline models


# --------------------------------------------------------------------------------------------------
# compatibility checks


@dataclass(frozen=True)
class ProcessorReport:
    """What :func:`check_same_processor` compared (the student's values; equal on both sides)."""

    image_token_id: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int | None
    max_pixels: int | None


def _image_settings(processor: Any) -> dict[str, Any]:
    ip = processor.image_processor
    size = dict(getattr(ip, "size", None) or {})
    return {
        "image processor class": type(ip).__name__,
        "patch_size": getattr(ip, "patch_size", None),
        "temporal_patch_size": getattr(ip, "temporal_patch_size", None),
        "merge_size": getattr(ip, "merge_size", None),
        "min_pixels (size.shortest_edge)": size.get("shortest_edge", size.get("min_pixels")),
        "max_pixels (size.longest_edge)": size.get("longest_edge", size.get("max_pixels")),
        "image_mean": list(getattr(ip, "image_mean", None) or []),
        "image_std": list(getattr(ip, "image_std", None) or []),
        "do_resize": getattr(ip, "do_resize", None),
        "do_rescale": getattr(ip, "do_rescale", None),
        "rescale_factor": getattr(ip, "rescale_factor", None),
        "do_normalize": getattr(ip, "do_normalize", None),
        "do_convert_rgb": getattr(ip, "do_convert_rgb", None),
        "resample": str(getattr(ip, "resample", None)),
    }


def _probe_ids(processor: Any, chat_template_kwargs: Mapping[str, Any] | None) -> list[int]:
    tok = processor.tokenizer
    text = tok.apply_chat_template(_PROBE_MESSAGES, chat_template=processor.chat_template,
                                   tokenize=False, add_generation_prompt=True,
                                   **dict(chat_template_kwargs or {}))
    return list(tok(text, add_special_tokens=False)["input_ids"])


def check_same_processor(
    student: Any,
    teacher: Any,
    *,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> ProcessorReport:
    """Refuse a teacher/student processor pair whose inputs would differ.

    Every prompt is prepared once by the student's processor and fed to both models, so this
    raises ``ValueError`` listing each difference in: the image / video / vision start and end
    token ids; the image processor's class, patch, temporal patch and merge sizes, pixel limits,
    rescaling and normalisation; and the token ids of a probe conversation (system turn, an image
    and a question, with the generation prompt) rendered by each processor's chat template (so the
    chat format's special tokens and the image placeholder agree).
    """
    diffs: list[str] = []
    s_ids, t_ids = vision_token_ids(student), vision_token_ids(teacher)
    for name in s_ids:
        if s_ids[name] != t_ids[name]:
            diffs.append(f"{name} token id: student {s_ids[name]} vs teacher {t_ids[name]}")
    s_img, t_img = _image_settings(student), _image_settings(teacher)
    for name in s_img:
        if s_img[name] != t_img[name]:
            diffs.append(f"{name}: student {s_img[name]!r} vs teacher {t_img[name]!r}")
    s_probe = _probe_ids(student, chat_template_kwargs)
    t_probe = _probe_ids(teacher, chat_template_kwargs)
    if s_probe != t_probe:
        at = next((i for i, (a, b) in enumerate(zip(s_probe, t_probe, strict=False)) if a != b),
                  min(len(s_probe), len(t_probe)))
        diffs.append(
            f"chat template: a probe conversation renders to different ids (student "
            f"{len(s_probe)} tokens, teacher {len(t_probe)}; first difference at token {at}: "
            f"{s_probe[at:at + 5]} vs {t_probe[at:at + 5]})"
        )
    if s_ids["image"] is None:
        diffs.append("the student's tokenizer has no image token <|image_pad|>")
    if diffs:
        raise ValueError("student and teacher processors differ (prompts and images are prepared "
                         "once, by the student's processor): " + "; ".join(diffs))
    return ProcessorReport(
        image_token_id=int(s_ids["image"]),  # type: ignore[arg-type]
        patch_size=int(s_img["patch_size"]), merge_size=int(s_img["merge_size"]),
        temporal_patch_size=int(s_img["temporal_patch_size"]),
        min_pixels=s_img["min_pixels (size.shortest_edge)"],
        max_pixels=s_img["max_pixels (size.longest_edge)"],
    )


def check_model_matches_processor(model: Any, processor: Any, *, role: str = "model") -> None:
    """Refuse a VLM whose config disagrees with the processor preparing its inputs.

    Compares ``config.image_token_id`` / ``video_token_id`` / ``vision_start_token_id`` with the
    processor's token ids and the vision config's ``patch_size``, ``spatial_merge_size`` and
    ``temporal_patch_size`` with the image processor's; raises ``ValueError`` naming ``role`` and
    every mismatch.
    """
    config = model.config
    ids = vision_token_ids(processor)
    diffs = []
    for name, key in (("image", "image_token_id"), ("video", "video_token_id"),
                      ("vision_start", "vision_start_token_id")):
        want = getattr(config, key, None)
        if want is not None and ids[name] is not None and int(want) != int(ids[name]):
            diffs.append(f"config.{key} = {want} but the processor's {name} token is {ids[name]}")
    vision = getattr(config, "vision_config", None)
    ip = processor.image_processor
    for key, proc_key in (("patch_size", "patch_size"), ("spatial_merge_size", "merge_size"),
                          ("temporal_patch_size", "temporal_patch_size")):
        want = getattr(vision, key, None)
        have = getattr(ip, proc_key, None)
        if want is not None and have is not None and want != have:
            diffs.append(f"vision_config.{key} = {want} but the image processor's {proc_key} "
                         f"is {have}")
    if diffs:
        raise ValueError(f"the {role} does not match the processor: " + "; ".join(diffs))
