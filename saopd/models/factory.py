"""Build a model and its tokenizer (and, for vision-language models, its processor) from a config
entry (``conf/model/*.yaml``)."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from saopd.config.model import TINY_VLM_KINDS, ModelConfig
from saopd.config.run import TrainerConfig
from saopd.config.train import TrainConfig
from saopd.models.loading import load_causal_lm, load_tokenizer, meta_causal_lm, resolve_source
from saopd.models.pruning import prune_layers
from saopd.models.sharding import defer_weights
from saopd.models.tiny import tiny_llama, tiny_qwen3, tiny_tokenizer
from saopd.models.tiny_vlm import tiny_vlm, tiny_vlm_processor, tiny_vlm_tokenizer
from saopd.models.vlm import (
    check_model_matches_processor,
    check_same_processor,
    load_vlm,
    load_vlm_processor,
    save_processor_for_vllm,
)
from saopd.models.vocab import VocabularyReport, check_vocabularies
from saopd.registry import Registry

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase



#: Wrappers applied to a built text model whose config has the matching block, by block name:
#: ``wrapper(model, tokenizer, block) -> model``. The testbeds' wrappers live above the scoring
#: layer they hook, so they are declared here by module and imported only when a config has their
#: block: ``planted`` (:func:`saopd.testbeds.planted.plant_priors`) and ``tic``
#: (:func:`saopd.testbeds.tic.plant_tic`).
MODEL_WRAPPERS: Registry[Callable[..., Any]] = Registry("model wrapper")
MODEL_WRAPPERS.declare("planted", "saopd.testbeds.planted")
MODEL_WRAPPERS.declare("tic", "saopd.testbeds.tic")

def load_device(trainer: TrainerConfig) -> torch.device | None:
    """Where a run's text models are loaded: this process's GPU (``cuda:LOCAL_RANK``, or the
    ``LOCAL_RANK``-th of a ``trainer.devices`` list) when the trainer runs on GPUs with whole
    models per process (one GPU, DDP) and CUDA is available; the ``meta`` device under
    ``trainer.strategy=fsdp`` (built empty, sharded, then each rank fills its own shards:
    :func:`saopd.models.sharding.materialize_sharded`); None (the CPU, Lightning moves the
    models later) on CPU otherwise."""
    if trainer.strategy == "fsdp":
        return torch.device("meta")
    if not torch.cuda.is_available() or trainer.accelerator not in ("gpu", "cuda", "auto"):
        return None
    local = int(os.environ.get("LOCAL_RANK", "0"))
    devices = trainer.devices
    if isinstance(devices, (list, tuple)) and devices:
        return torch.device("cuda", int(devices[local % len(devices)]))
    return torch.device("cuda", local)


def builds_on_meta(cfg: ModelConfig) -> bool:
    """True if :func:`build_model` can build ``cfg`` on the meta device: text models, tiny or
    from an HF folder / hub id, pruned or not (a GGUF file, a vision-language model or a
    testbed's wrapped model is built on the CPU)."""
    if cfg.is_vision or cfg.planted is not None or cfg.tic is not None:
        return False
    return cfg.tiny is not None or not str(cfg.name_or_path).lower().endswith(".gguf")


def full_model(cfg: ModelConfig) -> PreTrainedModel:
    """``cfg``'s model with its weights, on the CPU: what :func:`build_model` builds without a
    device (rank 0's copy for a meta-device model, :func:`saopd.models.sharding.defer_weights`)."""
    return build_model(cfg)[0]


def build_model(cfg: ModelConfig, *, device: torch.device | str | None = None
                ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load or build the model (eval mode) and its tokenizer, pruning layers if asked.

    ``device``: a hub / folder model is loaded straight onto it in ``cfg.dtype``
    (:func:`~saopd.models.loading.load_causal_lm`), a tiny one moved there once built; None =
    the CPU. ``meta``: the model's structure only, no memory
    (:func:`~saopd.models.loading.meta_causal_lm`, or the tiny model built under the meta
    device), marked to be filled after FSDP sharding from :func:`full_model`
    (:func:`~saopd.models.sharding.defer_weights`); a config that cannot be built there
    (:func:`builds_on_meta`) is built on the CPU. For a vision-language config this returns the
    model and its processor's tokenizer (on the CPU); use :func:`build_vlm` when the processor
    is needed (prompts with images).
    """
    if cfg.is_vision:
        model, processor = build_vlm(cfg)
        return model, processor.tokenizer
    meta = device is not None and torch.device(device).type == "meta"
    if meta and not builds_on_meta(cfg):
        meta, device = False, None
    if cfg.tiny is not None:
        tokenizer = tiny_tokenizer()
        make = tiny_qwen3 if cfg.tiny == "qwen3" else tiny_llama
        with torch.device("meta") if meta else nullcontext():
            model = make(tokenizer, layers=cfg.tiny_layers, hidden=cfg.tiny_hidden,
                         seed=cfg.seed)
        if device is not None and not meta:
            model = model.to(device)
    else:
        assert cfg.name_or_path is not None
        if meta:
            model = meta_causal_lm(cfg.name_or_path, dtype=cfg.dtype,
                                   trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
        else:
            model = load_causal_lm(cfg.name_or_path, dtype=cfg.dtype,
                                   trust_remote_code=cfg.trust_remote_code,
                                   revision=cfg.revision, device=device)
        tokenizer = load_tokenizer(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code,
                                   revision=cfg.revision)
    if meta:
        defer_weights(model, functools.partial(full_model, cfg))
    if cfg.prune_every is not None or cfg.prune_keep is not None:
        model = prune_layers(model, keep=cfg.prune_keep, every=cfg.prune_every)
    for block in ("planted", "tic"):
        if getattr(cfg, block) is not None:
            model = MODEL_WRAPPERS.get(block)(model, tokenizer, getattr(cfg, block))
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
            teacher's contexts when ``scored_contexts == "own"``.
        processor: the student's processor for a vision-language pair (the teacher's was
            checked equal), None for text pairs.
        vocab: the graded tokenizer check (:func:`~saopd.models.vocab.check_vocabularies`): its
            ``kind``, the response id map and ``common_logits``, the head width both models
            score over.
        scored_contexts: what the teacher scores under the run's ``teacher_contexts``
            (:meth:`~saopd.models.vocab.VocabularyReport.scored_contexts`): ``"student"`` (the
            student's ids) or ``"own"`` (its own template, response ids mapped).
    """

    student: PreTrainedModel
    teacher: PreTrainedModel | None
    tokenizer: PreTrainedTokenizerBase
    teacher_tokenizer: PreTrainedTokenizerBase
    processor: Any | None
    vocab: VocabularyReport
    scored_contexts: str = "student"
    #: with a teacher-scoring service (:func:`build_student_for_service`): the teacher's model
    #: folder or hub id for vLLM (None when not asked for), and whether it is a temporary
    #: folder written here (the service removes it)
    teacher_source: str | None = None
    teacher_source_owned: bool = False


def build_pair(student_cfg: ModelConfig, teacher_cfg: ModelConfig, *,
               chat_template_kwargs: Mapping[str, Any] | None = None,
               teacher_contexts: str = "auto",
               device: torch.device | str | None = None) -> ModelPair:
    """Build student and teacher and check that they can be distilled one into the other.

    ``device``: where text models are loaded (:func:`build_model`; None = the CPU).

    Both must be text models or both vision-language models; a VLM pair's processors must agree
    (:func:`~saopd.models.vlm.check_same_processor`, rendering with ``chat_template_kwargs``),
    and every pair must pass the graded tokenizer check (:func:`check_vocabularies`: same
    ordinary-text ids; templates and special tokens may differ for text pairs). What the
    teacher scores follows ``teacher_contexts`` (``auto`` | ``student`` | ``own``;
    :func:`scored_contexts`). Raises ``ValueError`` saying which check failed.
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
        student, tokenizer = build_model(student_cfg, device=device)
        teacher, teacher_tok = build_model(teacher_cfg, device=device)
    vocab = check_vocabularies(tokenizer, teacher_tok, student, teacher)
    scored = scored_contexts(vocab, teacher_contexts, vision=processor is not None)
    return ModelPair(student, teacher, tokenizer, teacher_tok, processor, vocab, scored)


def scored_contexts(vocab: VocabularyReport, teacher_contexts: str, *, vision: bool) -> str:
    """What the teacher scores (``"student"`` | ``"own"``) for a graded pair under the run's
    ``teacher_contexts`` (:meth:`VocabularyReport.scored_contexts`). Teacher-own contexts are
    built for text pairs only: a vision-language pair that would need them is refused
    (``ValueError``; under ``auto``, every kind but ``same``), and so is ``student`` for a
    ``specials_differ`` pair."""
    scored = vocab.scored_contexts(teacher_contexts)
    if vision and scored == "own":
        hints = {"same": "; this pair shares one template: use teacher_contexts=auto or student",
                 "template_differs": "; teacher_contexts=student has the teacher score the "
                                     "student's ids (the processor check found both templates "
                                     "render a probe conversation to the same ids)"}
        raise ValueError(
            f"this vision-language pair is {vocab.kind} and teacher_contexts={teacher_contexts} "
            "has the teacher score its own contexts, which are built for text pairs only"
            + hints.get(vocab.kind, ""))
    return scored


def vllm_model_folder(location: str, parent: str | Path | None = None) -> tuple[str, bool]:
    """``(folder, owned)``: ``location`` as vLLM should load it. vLLM reads every
    ``*.safetensors`` file of a folder as weights, so a folder holding other safetensors files
    beside the model's (saopd's converted SmolLM2 keeps ``saopd_reference.safetensors``) is
    served through a new folder of links to everything but those (``owned``: remove it after
    use); anything else (a clean folder, a hub id) is returned as it is."""
    folder = Path(location)
    if not folder.is_dir():
        return location, False
    extra = [f for f in folder.glob("*.safetensors") if not f.name.startswith("model")]
    if not extra:
        return location, False
    base = Path(parent) if parent is not None else (
        Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    view = Path(tempfile.mkdtemp(prefix="saopd-teacher-view-", dir=base))
    atexit.register(shutil.rmtree, view, True)
    for item in folder.iterdir():
        if item not in extra:
            (view / item.name).symlink_to(item.resolve())
    return str(view), True


def _auto_config(location: str, cfg: ModelConfig) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(location, trust_remote_code=cfg.trust_remote_code,
                                      revision=cfg.revision)


def build_student_for_service(student_cfg: ModelConfig, teacher_cfg: ModelConfig, *,
                              chat_template_kwargs: Mapping[str, Any] | None = None,
                              teacher_contexts: str = "auto",
                              teacher_folder: bool = True,
                              folder_parent: str | Path | None = None,
                              device: torch.device | str | None = None) -> ModelPair:
    """The student and the teacher's tokenizer (processor) and config, checked as
    :func:`build_pair` checks a pair, without the teacher's weights: for a teacher-scoring
    service (``teacher_scoring=vllm|vllm_server``) that scores the teacher elsewhere.

    ``teacher_folder``: also give the folder (or hub id) a vLLM engine of the teacher loads
    (``ModelPair.teacher_source``). An HF folder or hub id is used where it is: its weights are
    never loaded here. A teacher that exists only once built (tiny, pruned, GGUF) is built once,
    saved with its tokenizer (processor) to a new folder under ``folder_parent`` (None = a
    temporary folder, in ``/dev/shm`` when the machine has it) and dropped
    (``teacher_source_owned``). A planted-prior teacher is refused: its logit hook exists only in
    saopd's module. ``ValueError`` as :func:`build_pair`.
    """
    if teacher_cfg.planted is not None or teacher_cfg.tic is not None:
        block = "planted" if teacher_cfg.planted is not None else "tic"
        raise ValueError(f"a testbed teacher (model.{block}) changes its logits in saopd's "
                         "module, which a vLLM teacher service cannot run: use "
                         "teacher_scoring=hf")
    if student_cfg.is_vision != teacher_cfg.is_vision:
        raise ValueError("student and teacher must both be vision-language models or both text "
                         f"models (student vision: {student_cfg.is_vision}, teacher vision: "
                         f"{teacher_cfg.is_vision})")
    processor = teacher_processor = None
    source, owned = None, False
    if teacher_cfg.loads_as_is:
        assert teacher_cfg.name_or_path is not None
        location = resolve_source(teacher_cfg.name_or_path, None, kind="model").location
        config = _auto_config(location, teacher_cfg)
        if teacher_cfg.is_vision:
            teacher_processor = load_vlm_processor(
                teacher_cfg.name_or_path, trust_remote_code=teacher_cfg.trust_remote_code,
                revision=teacher_cfg.revision, min_pixels=teacher_cfg.min_pixels,
                max_pixels=teacher_cfg.max_pixels)
            teacher_tok = teacher_processor.tokenizer
        else:
            teacher_tok = load_tokenizer(teacher_cfg.name_or_path,
                                         trust_remote_code=teacher_cfg.trust_remote_code,
                                         revision=teacher_cfg.revision)
        if teacher_folder:
            source, owned = vllm_model_folder(location, folder_parent)
    else:  # built in memory: saved once for the service, then dropped
        if teacher_cfg.is_vision:
            model, teacher_processor = build_vlm(teacher_cfg)
            teacher_tok = teacher_processor.tokenizer
        else:
            model, teacher_tok = build_model(teacher_cfg)
        config = model.config
        if teacher_folder:
            parent = Path(folder_parent) if folder_parent is not None else (
                Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
            if parent is not None:
                parent.mkdir(parents=True, exist_ok=True)
            folder = Path(tempfile.mkdtemp(prefix="saopd-teacher-", dir=parent))
            atexit.register(shutil.rmtree, folder, True)  # gone at exit whatever happens
            try:
                model.save_pretrained(folder, safe_serialization=True)
                if teacher_processor is not None:
                    save_processor_for_vllm(teacher_processor, folder, config.model_type)
                else:
                    teacher_tok.save_pretrained(folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            source, owned = str(folder), True
        del model
    if student_cfg.is_vision:
        student, processor = build_vlm(student_cfg)
        assert teacher_processor is not None
        check_same_processor(processor, teacher_processor,
                             chat_template_kwargs=chat_template_kwargs)
        tokenizer = processor.tokenizer
    else:
        student, tokenizer = build_model(student_cfg, device=device)
    # the teacher's head width from its config (no weights here)
    vocab = check_vocabularies(tokenizer, teacher_tok, student, SimpleNamespace(config=config))
    try:
        scored = scored_contexts(vocab, teacher_contexts, vision=processor is not None)
    except ValueError:
        if owned and source is not None:
            shutil.rmtree(source, ignore_errors=True)
        raise
    return ModelPair(student, None, tokenizer, teacher_tok, processor, vocab, scored,
                     teacher_source=source, teacher_source_owned=owned)


def build_models(conf: TrainConfig) -> ModelPair:
    """The run's pair from its config: both models (:func:`build_pair`) when the trainer scores
    the teacher itself (``teacher_scoring=hf``), else the student and the teacher's tokenizer
    and config only (:func:`build_student_for_service`), with the teacher's model folder for
    ``teacher_scoring=vllm``. ``ValueError`` as those.

    Text models are loaded straight onto the run's GPU (:func:`load_device`), except next to an
    in-process vLLM engine (``rollout=vllm``, ``teacher_scoring=vllm``), which sizes its memory
    from the GPU's free memory when it starts: there they load on the CPU and Lightning moves
    them once the engine holds its share. Under ``trainer.strategy=fsdp`` with ``rollout=hf``
    they are built on the meta device (:func:`load_device`) and filled shard by shard when the
    module is sharded (:meth:`saopd.lightning.module.OPDModule.configure_model`); another
    rollout engine keeps them on the CPU, as it copies the student's weights when built."""
    ts = conf.teacher_scoring
    engine = getattr(conf.rollout, "engine", None)
    device = load_device(conf.trainer)
    if device is not None and device.type == "meta":
        if engine != "hf":  # an engine with its own copy reads the student's weights when built
            device = None
    elif "vllm" in (engine, ts.backend):
        device = None
    if ts.backend == "hf":
        return build_pair(conf.student, conf.teacher,
                          chat_template_kwargs=conf.data.chat_template_kwargs,
                          teacher_contexts=conf.teacher_contexts, device=device)
    return build_student_for_service(conf.student, conf.teacher,
                                     chat_template_kwargs=conf.data.chat_template_kwargs,
                                     teacher_contexts=conf.teacher_contexts,
                                     teacher_folder=ts.backend == "vllm",
                                     folder_parent=ts.model_dir, device=device)
