"""Teacher-scoring backends by config name (``teacher_scoring=<backend>``), built from a run's
config.

:data:`SCORERS` maps each backend of ``conf/teacher_scoring/`` to a factory
``(conf, pair) -> TeacherScorer | None``: ``hf`` gives None (the training module holds the
teacher and scores it itself, with its head for the exact KL), ``vllm`` a
:class:`~saopd.vllm.teacher.VLLMTeacherScorer` of the pair's teacher folder, ``vllm_server`` a
:class:`~saopd.vllm.client.teacher.VLLMServerTeacherScorer` of the configured servers, each
checked to serve this teacher. The two vLLM factories import their scorer from
:mod:`saopd.vllm` when they run (the only imports from :mod:`saopd.scoring` into it:
``ignore_imports`` of the layers contract in pyproject.toml), so this module imports without
it. A new backend registers its factory here (``SCORERS.add(name, factory)``) and adds its
config file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from saopd.config.train import TrainConfig
from saopd.data_parallel import num_training_processes
from saopd.models.factory import ModelPair
from saopd.registry import Registry
from saopd.scoring.teacher_service import TeacherScorer

ScorerFactory = Callable[[TrainConfig, ModelPair], "TeacherScorer | None"]

#: backend name -> factory of its scorer from the run's config and models
SCORERS: Registry[Any] = Registry("teacher_scoring backend")


def build_scorer(conf: TrainConfig, pair: ModelPair) -> TeacherScorer | None:
    """The scorer ``conf.teacher_scoring.backend`` names, or None for ``hf`` (the module scores
    with the teacher it holds). ``ValueError`` for an unknown backend (listing the known ones)
    or options the backend refuses."""
    factory: ScorerFactory = SCORERS.get(conf.teacher_scoring.backend)
    return factory(conf, pair)


def _hf(conf: TrainConfig, pair: ModelPair) -> None:
    """``hf``: no service; the teacher's module is in ``pair.teacher``."""
    return None


def _vllm(conf: TrainConfig, pair: ModelPair) -> TeacherScorer:
    """``vllm``: a ``vllm.LLM`` of the pair's teacher folder (``pair.teacher_source``)."""
    ts = conf.teacher_scoring
    if ts.in_process and conf.rollout.engine == "vllm" and bool(
            getattr(conf.rollout, "in_process", False)):
        raise ValueError("teacher_scoring.in_process=true with an in-process rollout=vllm: two "
                         "vLLM engine cores cannot share the training process; set "
                         "teacher_scoring.in_process=false (the default)")
    if pair.teacher_source is None:
        raise ValueError("teacher_scoring=vllm needs the teacher as a model folder: build the "
                         "pair with build_models (teacher_folder for vllm)")
    from saopd.vllm.teacher import VLLMTeacherScorer

    return VLLMTeacherScorer(
        pair.teacher_source, top_k=ts.top_k,
        dtype=conf.teacher.dtype if ts.dtype == "auto" else ts.dtype,
        max_model_len=ts.max_model_len, gpu_memory_utilization=ts.gpu_memory_utilization,
        kv_cache_gb=ts.kv_cache_gb, enforce_eager=ts.enforce_eager,
        tensor_parallel_size=ts.tensor_parallel_size, in_process=ts.in_process,
        devices=ts.devices,
        clean_environment=num_training_processes(conf.trainer.devices,
                                                 conf.trainer.num_nodes) > 1,
        processor=pair.processor, max_images_per_prompt=ts.max_images_per_prompt,
        seed=conf.seed, owned_dir=pair.teacher_source_owned)


def _vllm_server(conf: TrainConfig, pair: ModelPair) -> TeacherScorer:
    """``vllm_server``: the configured servers, each checked against the teacher's config,
    tokenizer and weight files (the key file read)."""
    from saopd.vllm.client.teacher import VLLMServerTeacherScorer

    return VLLMServerTeacherScorer.from_config(conf.teacher_scoring, conf.teacher,
                                               pair.teacher_tokenizer)


SCORERS.add("hf", _hf)
SCORERS.add("vllm", _vllm)
SCORERS.add("vllm_server", _vllm_server)
