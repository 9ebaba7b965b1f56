"""Build a model and its tokenizer (and, for vision-language models, its processor) from a config
entry (``conf/model/*.yaml``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from saopd.config.model import TINY_VLM_KINDS, ModelConfig
from saopd.models.loading import load_causal_lm, load_tokenizer
from saopd.models.pruning import prune_layers
from saopd.models.tiny import tiny_llama, tiny_qwen3, tiny_tokenizer
from saopd.models.tiny_vlm import tiny_vlm, tiny_vlm_processor, tiny_vlm_tokenizer
from saopd.models.vlm import (
    check_model_matches_processor,
    check_same_processor,
    load_vlm,
    load_vlm_processor,
)
from saopd.models.vocab import VocabularyReport, check_vocabularies
from saopd.registry import Registry

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase



#: Wrappers applied to a built text model whose config has the matching block, by block name:
#: ``wrapper(model, tokenizer, block) -> model``. :mod:`saopd.testbeds` registers ``planted``
#: (:func:`saopd.testbeds.planted.plant_priors`), which lives above the scoring layer it hooks.
MODEL_WRAPPERS: Registry[Callable[..., Any]] = Registry("model wrapper")

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
        if "planted" not in MODEL_WRAPPERS:
            raise ValueError("model.planted needs the planted-prior wrapper, registered by "
                             "importing saopd.testbeds (saopd-train and saopd-eval do)")
        model = MODEL_WRAPPERS.get("planted")(model, tokenizer, cfg.planted)
    return model, tokenizer


def build_vlm(cfg: ModelConfig) -> tuple[PreTrainedModel, Any]:
    """Load or build a vision-language model (eval mode) and its PIL-only processor.

    Hub ids and folders go through :func:`saopd.models.vlm.load_vlm` /
    :func:`~saopd.models.vlm.load_vlm_processor`; tiny kinds are built offline. The model's
    config is checked against the processor
    (:func:`~saopd.models.vlm.check_model_matches_processor`).
    Raises ``ValueError`` for a text-only config.
    """
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


@dataclass
class ModelPair:
    """A teacher/student pair ready for training, checked compatible.

    Attributes:
        student, teacher: the two models (eval mode as built).
        tokenizer: the student's tokenizer (its ordinary-text ids are the teacher's).
        teacher_tokenizer: the teacher's own tokenizer; its chat template renders the
            teacher's contexts when ``vocab.teacher_contexts``.
        processor: the student's processor for a vision-language pair (the teacher's was
            checked equal), None for text pairs.
        vocab: the graded tokenizer check (:func:`~saopd.models.vocab.check_vocabularies`): its
            ``kind``, the response id map and ``common_logits``, the head width both models
            score over.
    """

    student: PreTrainedModel
    teacher: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    teacher_tokenizer: PreTrainedTokenizerBase
    processor: Any | None
    vocab: VocabularyReport


def build_pair(student_cfg: ModelConfig, teacher_cfg: ModelConfig, *,
               chat_template_kwargs: Mapping[str, Any] | None = None) -> ModelPair:
    """Build student and teacher and check that they can be distilled one into the other.

    Both must be text models or both vision-language models; a VLM pair's processors must agree
    (:func:`~saopd.models.vlm.check_same_processor`, rendering with ``chat_template_kwargs``),
    and every pair must pass the graded tokenizer check (:func:`check_vocabularies`: same
    ordinary-text ids; templates and special tokens may differ for text pairs, and the teacher
    then scores its own contexts). A vision-language pair must be of kind ``same``. Raises
    ``ValueError`` saying which check failed.
    """
    if student_cfg.is_vision != teacher_cfg.is_vision:
        raise ValueError("student and teacher must both be vision-language models or both text "
                         f"models (student vision: {student_cfg.is_vision}, teacher vision: "
                         f"{teacher_cfg.is_vision})")
    processor = None
    if student_cfg.is_vision:
        student, processor = build_vlm(student_cfg)
        teacher, teacher_processor = build_vlm(teacher_cfg)
        check_same_processor(processor, teacher_processor,
                             chat_template_kwargs=chat_template_kwargs)
        tokenizer, teacher_tok = processor.tokenizer, teacher_processor.tokenizer
    else:
        student, tokenizer = build_model(student_cfg)
        teacher, teacher_tok = build_model(teacher_cfg)
    vocab = check_vocabularies(tokenizer, teacher_tok, student, teacher)
    if processor is not None and vocab.teacher_contexts:
        raise ValueError(
            "a vision-language teacher must share the student's tokenizer and chat template "
            f"(this pair: {vocab.describe()}); teacher-own contexts are built for text pairs "
            "only")
    return ModelPair(student, teacher, tokenizer, teacher_tok, processor, vocab)
