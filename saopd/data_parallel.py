"""Data-parallel facts and collectives: which rank this process is, how many there are, and the
sums, maxima and row gathers over them.

Training runs as ``W`` data-parallel ranks (``trainer.strategy=ddp|fsdp``, one process each, a
``torch.distributed`` default process group). Every package that needs a rank, the world size or
a collective takes it from here: the batch-global filters (:mod:`saopd.filters.distributed`,
paper Eq. 16-17 over the whole batch), the step's global loss normalisation (Eq. 19, the global
count of loss-carrying tokens), FSDP's synced generation, and the colocated rollout engines.

Two kinds of fact:

- of the *process group* (:func:`rank`, :func:`world_size`): with no initialised group (one
  process, or before Lightning starts one) the process is rank 0 of 1, and every collective here
  returns its input;
- of the *launch* (:func:`training_rank`, :func:`training_world_size`,
  :func:`num_training_processes` from the trainer's settings): the group's when it
  exists, otherwise what the launcher's variables say (``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE``, Lightning's ``NODE_RANK`` / ``LOCAL_WORLD_SIZE``), for code that runs before
  the group is initialised (building a colocated engine per rank).

Only ``torch.distributed`` is used, so this module sits below every package that needs it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_reduce_max",
    "all_reduce_sum",
    "gather_rows",
    "is_distributed",
    "num_training_processes",
    "rank",
    "training_rank",
    "training_world_size",
    "world_size",
]


def is_distributed() -> bool:
    """True when ``torch.distributed`` has an initialised default process group."""
    return dist.is_available() and dist.is_initialized()


def rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (the default group when None); 0 without a process
    group."""
    return dist.get_rank(group) if is_distributed() else 0


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (the default group when None); 1 without a process group."""
    return dist.get_world_size(group) if is_distributed() else 1


def _env_int(name: str, default: int = 0) -> int:
    return int(os.environ.get(name, "") or default)


def training_rank() -> tuple[int, int]:
    """``(global rank, local rank)`` of this training process: the process group's global rank
    when there is one, else the launcher's ``RANK``, else Lightning's launch
    (``NODE_RANK`` x ``LOCAL_WORLD_SIZE`` + ``LOCAL_RANK``); the local rank is ``LOCAL_RANK``.
    ``(0, 0)`` for the first process of a Lightning launch, before it starts the others."""
    local = _env_int("LOCAL_RANK")
    if is_distributed():
        return dist.get_rank(), local
    if os.environ.get("RANK"):
        return int(os.environ["RANK"]), local
    per_node = _env_int("LOCAL_WORLD_SIZE")
    node = int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")) or 0)
    return (node * per_node + local if per_node else local), local


def training_world_size() -> int:
    """Training processes of this launch: the process group's size when there is one, else the
    launcher's ``WORLD_SIZE``, else 1."""
    return world_size() if is_distributed() else max(1, _env_int("WORLD_SIZE", 1))


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
        per_node = max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1
    return per_node * max(1, int(num_nodes))


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum of ``value`` over all ranks of the default group (a detached copy; ``value`` itself
    without a group). Every rank must call it."""
    if world_size() == 1:
        return value
    out = value.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_reduce_max(value: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Element-wise maximum of ``value`` over the ranks of ``group`` (a detached copy; ``value``
    itself without a group). Every rank of ``group`` must call it."""
    if world_size(group) == 1:
        return value
    out = value.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


def gather_rows(local: torch.Tensor, width: int, group: dist.ProcessGroup | None = None
                ) -> tuple[torch.Tensor, list[int]]:
    """All ranks' ``[B_r, T_r, *rest]`` tensors as one ``[sum B_r, width, *rest]`` tensor, in
    rank order (``rest``, e.g. the K of a top-k field, is the same on every rank).

    Columns past a rank's ``T_r`` are zero (False for bool). Returns the tensor and every
    rank's row count. ``width`` must be >= every ``T_r`` (the max over ranks). Every rank of
    ``group`` must call it; without a process group it returns ``local`` padded to ``width``.
    """
    world = world_size(group)
    rows = torch.tensor([local.shape[0]], device=local.device)
    padded_rows = local.shape[0]
    sizes = [padded_rows]
    if world > 1:
        counts = [torch.zeros_like(rows) for _ in range(world)]
        dist.all_gather(counts, rows, group=group)
        sizes = [int(c) for c in counts]
        padded_rows = max(sizes)
    padded = torch.zeros((padded_rows, width, *local.shape[2:]), dtype=local.dtype,
                         device=local.device)
    padded[: local.shape[0], : local.shape[1]] = local
    if world == 1:
        return padded, sizes
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)]), sizes
