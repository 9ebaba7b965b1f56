"""Tiny random-init vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 families) with a
PIL-only processor, built offline on the tiny or the real Qwen vocabulary (tests, smoke runs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from saopd.config.model import TINY_VLM_KINDS
from saopd.models.tiny import tiny_tokenizer
from saopd.models.tokenizers import qwen_tokenizer
from saopd.models.vlm import (
    QWEN_VL_CHAT_TEMPLATE,
    VISION_SPECIAL_TOKENS,
    VLM_FAMILIES,
    image_only_processor,
    pil_image_processor,
    pixel_kwargs,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase
    from transformers.processing_utils import ProcessorMixin

__all__ = ["tiny_vlm", "tiny_vlm_processor", "tiny_vlm_tokenizer"]


def tiny_vlm_tokenizer(kind: str = "tiny") -> PreTrainedTokenizerBase:
    """An offline tokenizer with Qwen's vision tokens and :data:`QWEN_VL_CHAT_TEMPLATE`.

    ``kind="tiny"``: the ~1k-token tiny BPE (:func:`saopd.models.tiny.tiny_tokenizer`) with
    :data:`VISION_SPECIAL_TOKENS` appended as special tokens; ``"qwen"``: Qwen's real 151,669-id
    tokenizer (:func:`saopd.models.tokenizers.qwen_tokenizer`), whose vision tokens sit at their
    official ids 151652-151656.
    """
    if kind == "tiny":
        tok = tiny_tokenizer()
        tok.add_tokens(list(VISION_SPECIAL_TOKENS), special_tokens=True)
    elif kind == "qwen":
        tok = qwen_tokenizer()
    else:
        raise ValueError(f"tiny VLM tokenizer must be 'tiny' or 'qwen', got {kind!r}")
    missing = [t for t in VISION_SPECIAL_TOKENS if t not in tok.get_vocab()]
    if missing:
        raise RuntimeError(f"the {kind} tokenizer lacks vision tokens {missing}")
    tok.chat_template = QWEN_VL_CHAT_TEMPLATE
    return tok


def tiny_vlm_processor(
    tokenizer: PreTrainedTokenizerBase,
    *,
    kind: str = "qwen2_vl",
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> ProcessorMixin:
    """A PIL-only processor for a tiny model of family ``kind`` on ``tokenizer``.

    Patch size 14 (Qwen2-VL, Qwen2.5-VL) or 16 (Qwen3-VL, Qwen3.5), merge 2, temporal patch 2, so
    one image token covers ``(2 * patch)**2`` pixels. Pixel limits default to 4 and 16 image tokens
    per image (``min_pixels = 4 * (2 * patch)**2``, ``max_pixels = 16 * (2 * patch)**2``): a 224x224
    image becomes a 4x4 grid of merged tokens, so CPU runs stay fast.
    """
    _check_tiny_kind(kind)
    patch = 14 if kind in ("qwen2_vl", "qwen2_5_vl") else 16
    unit = (2 * patch) ** 2
    pixels = pixel_kwargs(min_pixels if min_pixels is not None else 4 * unit,
                           max_pixels if max_pixels is not None else 16 * unit)
    image_processor = pil_image_processor(patch_size=patch, merge_size=2, temporal_patch_size=2,
                                           **pixels)
    cls = image_only_processor(VLM_FAMILIES[kind])
    template = getattr(tokenizer, "chat_template", None) or QWEN_VL_CHAT_TEMPLATE
    return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)


def _check_tiny_kind(kind: str) -> None:
    if kind not in TINY_VLM_KINDS:
        raise ValueError(f"tiny VLM kind must be one of {list(TINY_VLM_KINDS)}, got {kind!r}")


def _tiny_vlm_config(kind: str, tokenizer: PreTrainedTokenizerBase, layers: int, hidden: int,
                     vision_depth: int, vision_hidden: int) -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3_5Config, Qwen3VLConfig

    ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(tok) for name, tok in (
        ("vision_start", "<|vision_start|>"), ("vision_end", "<|vision_end|>"),
        ("image", "<|image_pad|>"), ("video", "<|video_pad|>"))}
    heads, head_dim = hidden // 32, 32  # head_dim 32: the smallest vLLM's CPU attention supports
    if hidden % 32 or heads < 1:
        raise ValueError(f"tiny VLM hidden size must be a positive multiple of 32, got {hidden}")
    text = {
        "vocab_size": len(tokenizer), "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 1,
        "max_position_embeddings": 4096, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
    }
    if kind == "qwen2_vl":  # head_dim = hidden / heads; M-RoPE sections (t, h, w) sum to 16
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [4, 6, 6],
                                   "rope_theta": 1e6}
        vision = {"depth": vision_depth, "embed_dim": vision_hidden, "hidden_size": hidden,
                  "num_heads": max(1, vision_hidden // 16), "mlp_ratio": 2, "patch_size": 14,
                  "spatial_merge_size": 2, "temporal_patch_size": 2}
        return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                             **ids)
    if kind == "qwen2_5_vl":  # Qwen2-VL's text model; a SwiGLU/RMSNorm tower with windowed
        # attention (112-pixel windows) and full attention in its last block
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [4, 6, 6],
                                   "rope_theta": 1e6}
        vision = {"depth": vision_depth, "hidden_size": vision_hidden,
                  "intermediate_size": 2 * vision_hidden, "num_heads": max(1, vision_hidden // 16),
                  "out_hidden_size": hidden, "patch_size": 14, "spatial_merge_size": 2,
                  "temporal_patch_size": 2, "window_size": 112,
                  "fullatt_block_indexes": [vision_depth - 1]}
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                                **ids)
    vision = {"depth": vision_depth, "hidden_size": vision_hidden,
              "intermediate_size": 2 * vision_hidden, "num_heads": max(1, vision_hidden // 16),
              "out_hidden_size": hidden, "patch_size": 16, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "num_position_embeddings": 64}
    if kind == "qwen3_vl":
        text.update(head_dim=head_dim, rope_parameters={
            "rope_type": "default", "mrope_section": [6, 5, 5], "mrope_interleaved": True,
            "rope_theta": 5e6})
        vision["deepstack_visual_indexes"] = [vision_depth - 1]
        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                             **ids)
    # qwen3_5: Gated DeltaNet linear attention layers with (gated) full attention every 4th layer
    # and always in the last one (the real models: 3 linear + 1 full, repeated)
    types = ["full_attention" if (i + 1) % 4 == 0 or i == layers - 1 else "linear_attention"
             for i in range(layers)]
    text.update(head_dim=head_dim, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=2, layer_types=types,
                rope_parameters={"rope_type": "default", "mrope_section": [4, 2, 2],
                                 "mrope_interleaved": True, "rope_theta": 1e7,
                                 "partial_rotary_factor": 0.5})
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)


def tiny_vlm(
    tokenizer: PreTrainedTokenizerBase,
    *,
    kind: str = "qwen2_vl",
    layers: int = 2,
    hidden: int = 64,
    vision_depth: int = 2,
    vision_hidden: int = 32,
    seed: int = 0,
) -> PreTrainedModel:
    """A random-init tiny Qwen-VL model (fp32, eval mode) of family ``kind``, sized to
    ``tokenizer`` (which must hold :data:`VISION_SPECIAL_TOKENS`, see :func:`tiny_vlm_tokenizer`).

    Text model: ``layers`` decoder layers of width ``hidden`` with head_dim 32 (``hidden / 32``
    query heads, 1 KV head); vision tower: ``vision_depth`` blocks of width ``vision_hidden``,
    projecting into the text width. Same arguments and seed give identical weights. About 0.2M
    parameters with the tiny tokenizer at the defaults.
    """
    from transformers import AutoModelForImageTextToText

    _check_tiny_kind(kind)
    missing = [t for t in VISION_SPECIAL_TOKENS if t not in tokenizer.get_vocab()]
    if missing:
        raise ValueError(f"the tokenizer lacks the vision tokens {missing}; build it with "
                         "tiny_vlm_tokenizer()")
    for name, value in (("layers", layers), ("vision_depth", vision_depth),
                        ("vision_hidden", vision_hidden)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    config = _tiny_vlm_config(kind, tokenizer, layers, hidden, vision_depth, vision_hidden)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    return model.eval()
