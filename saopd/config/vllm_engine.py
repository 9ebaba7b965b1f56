"""The options of a vLLM engine that saopd starts itself, declared once: ``rollout=vllm`` (the
student's copy, :class:`~saopd.config.rollout.VLLMRolloutConfig`) and ``teacher_scoring=vllm``
(the teacher's engine, :class:`~saopd.config.teacher_scoring.TeacherScoringConfig`) inherit
them from :class:`VLLMEngineOptions`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from saopd.choices import VLLM_DTYPES
from saopd.validation import check_choice, check_int, check_number

__all__ = ["VLLMEngineOptions", "engine_option_names"]


@dataclass
class VLLMEngineOptions:
    """A vLLM engine's options (``rollout.<name>`` / ``teacher_scoring.<name>``).

    Attributes:
        dtype: the engine's dtype: ``auto`` (the model's: the student's for ``rollout=vllm``,
            the teacher config's ``dtype`` for ``teacher_scoring=vllm``) | ``float32`` |
            ``bfloat16`` | ``float16``.
        max_model_len: prompt + response (a teacher: context) limit of the engine (null = the
            model's).
        gpu_memory_utilization: memory fraction for weights + KV cache, in (0, 1] (GPU; on the
            CPU backend it would be of the machine's RAM, and is not used: see kv_cache_gb).
        kv_cache_gb: KV-cache size in GiB instead of the fraction. null: the fraction on GPU;
            on vLLM's CPU backend saopd sizes the cache before vLLM starts (room for
            ``max_num_seqs`` x ``max_model_len`` tokens, at most a quarter of the free memory
            after the weights; :func:`saopd.vllm.runtime.cpu_kv_cache_bytes`) or
            refuses the run naming this option.
        enforce_eager: no CUDA graphs / compilation (faster start-up, slower decoding).
        tensor_parallel_size: GPUs the engine shards the model over. ``rollout=vllm`` with
            several training processes: t > 1 makes each group of t consecutive ranks share one
            engine sharded over their devices (vLLM's external launcher in the training
            processes; t must divide the processes per node; docs/vllm.md).
        model_dir: where a model that exists only in memory is saved for vLLM (null = a
            temporary folder in ``/dev/shm``, removed at exit): the initial student
            (``rollout``), a tiny, pruned or GGUF teacher (``teacher_scoring``; folders and
            hub ids are served from where they are).
        max_images_per_prompt: vLLM's image limit per prompt for vision-language models
            (``limit_mm_per_prompt``; memory is reserved for this many); a prompt with more
            images is refused, naming it. Ignored for text models.
        startup_timeout: seconds the engine's start-up may take before the run stops with a
            message (``teacher_scoring=vllm_server``: the servers' ``/health``).
    """

    dtype: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_gb: float | None = None
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    model_dir: str | None = None
    max_images_per_prompt: int = 4
    startup_timeout: float = 600.0

    def check_engine_options(self, owner: str) -> None:
        """``ValueError`` naming ``<owner>.<option>`` for an option out of its range."""
        check_choice("dtype", self.dtype, VLLM_DTYPES, owner=owner)
        check_int("max_model_len", self.max_model_len, owner=owner, allow_none=True)
        check_number("gpu_memory_utilization", self.gpu_memory_utilization, low=0.0, high=1.0,
                     owner=owner)
        check_number("kv_cache_gb", self.kv_cache_gb, low=0.0, owner=owner, allow_none=True)
        check_int("tensor_parallel_size", self.tensor_parallel_size, owner=owner)
        check_int("max_images_per_prompt", self.max_images_per_prompt, owner=owner)
        check_number("startup_timeout", self.startup_timeout, low=0.0, owner=owner)


def engine_option_names() -> tuple[str, ...]:
    """The names of :class:`VLLMEngineOptions`' fields, in order."""
    return tuple(f.name for f in fields(VLLMEngineOptions))
