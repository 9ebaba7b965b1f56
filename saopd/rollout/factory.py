"""Build the configured rollout engine (``conf/rollout/<engine>.yaml``) for a student.

``saopd-train`` calls :func:`build_engine` with ``conf.rollout`` (a
:class:`saopd.config.RolloutConfig`, read here by attribute so that this layer does not import
the Hydra schema) and :func:`holds_weights` to know whether the engine needs the student's
weights after every optimizer step.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from saopd.rollout.base import RolloutEngine

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["ENGINE_NAMES", "build_engine", "holds_weights", "num_training_processes"]

ENGINE_NAMES = ("hf", "vllm")


def holds_weights(engine: RolloutEngine) -> bool:
    """True for engines with their own copy of the weights (vLLM): they need ``load_weights``
    after every optimizer step (and once at the start, after a checkpoint is restored)."""
    return bool(getattr(engine, "holds_weights", False))


def num_training_processes(devices: Any, num_nodes: int = 1) -> int:
    """Processes Lightning will start for ``trainer.devices`` x ``num_nodes`` (``auto`` / -1:
    every visible GPU, one process on CPU)."""
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, (list, tuple)):
        per_node = len(devices)
    elif isinstance(devices, int) and devices > 0:
        per_node = devices
    else:  # "auto", -1
        import torch

        per_node = max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1
    return per_node * max(1, int(num_nodes))


def build_engine(
    conf: Any,
    student: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_prompt_length: int | None = None,
    prompt_truncation: str = "error",
    seed: int = 0,
    devices: Any = 1,
    num_nodes: int = 1,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    processor: Any | None = None,
) -> RolloutEngine:
    """The rollout engine ``conf.engine`` names, sampling from ``student``.

    Args:
        conf: the rollout config (``engine``, ``batch_size``, ``greedy`` and, for vLLM, the
            options of :class:`saopd.config.RolloutConfig`).
        student, tokenizer: the model being trained and its tokenizer. ``hf`` samples from the
            live module; ``vllm`` saves it (to ``conf.model_dir``, or a temporary folder under
            ``/dev/shm``) and starts ``vllm.LLM`` on the copy.
        max_prompt_length, prompt_truncation: the prompt limit and what to do beyond it.
        seed: vLLM's own seed (requests carry their own seeds when sampling is seeded).
        devices, num_nodes: the trainer's, to refuse ``vllm`` with more than one training
            process (each would start an engine of its own on the first GPU).
        chat_template_kwargs: passed to the chat template (e.g. ``enable_thinking: false``).
        processor: the student's Qwen-VL processor for a vision-language student (prompts may
            then hold images; ``vllm`` saves it with the model and sends images as multimodal
            inputs).

    Raises:
        ValueError: unknown engine, several training processes with ``vllm``, bad vLLM
            options.
        ImportError: ``vllm`` is not installed (with how to install it).
    """
    name = getattr(conf, "engine", None)
    if name == "hf":
        from saopd.rollout.hf import HFGenerateEngine

        return HFGenerateEngine(student, tokenizer, batch_size=conf.batch_size,
                                greedy=conf.greedy, max_prompt_length=max_prompt_length,
                                prompt_truncation=prompt_truncation,
                                chat_template_kwargs=chat_template_kwargs, processor=processor)
    if name != "vllm":
        raise ValueError(f"rollout.engine must be one of {list(ENGINE_NAMES)}, got {name!r}")
    processes = num_training_processes(devices, num_nodes)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if max(processes, world) > 1:
        raise ValueError(
            f"rollout.engine=vllm runs with one training process only (this run would start "
            f"{max(processes, world)}: every rank would start its own vLLM engine); use "
            "rollout=hf with several devices")
    from saopd.rollout.vllm import VLLMEngine

    return VLLMEngine.from_model(
        student, tokenizer, model_dir=conf.model_dir, greedy=conf.greedy,
        max_prompt_length=max_prompt_length, prompt_truncation=prompt_truncation,
        chat_template_kwargs=chat_template_kwargs, dtype=conf.dtype,
        max_model_len=conf.max_model_len, gpu_memory_utilization=conf.gpu_memory_utilization,
        kv_cache_gb=conf.kv_cache_gb, enforce_eager=conf.enforce_eager,
        tensor_parallel_size=conf.tensor_parallel_size, enable_sleep_mode=conf.enable_sleep_mode,
        sleep_level=conf.sleep_level, weight_bucket_mb=conf.weight_bucket_mb,
        sync_transport=conf.sync_transport, verify_sync=conf.verify_sync,
        in_process=conf.in_process, seed=seed, processor=processor,
        max_images_per_prompt=conf.max_images_per_prompt,
    )
