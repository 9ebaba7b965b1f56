"""Batch-global filtering when a step's rollouts are split across data-parallel ranks.

SA-OPD's Bottom_p1 / Top_p2 selections and FLMR are defined over the valid tokens of the whole
batch (paper Eq. 16-17). When each rank holds only its share of the rollouts, every rank gathers
the detached signals the filter reads from all ranks, runs the filter on the global batch (the
same computation on every rank) and keeps the rows that are its own. Because rows are
concatenated in rank order and filters are padding-invariant (ranks are taken over the compact
valid tokens, row-major), N ranks select exactly the tokens one process selects for the
concatenated batch, and the statistics (FLMR, filtered ratio, alpha) are the global ones.

Only ``torch.distributed`` is used; with no initialised process group (or one rank) the filter
runs locally.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from saopd.filters.base import FilterResult, TokenFilter
from saopd.signals.token_signals import TokenSignals


def world_size() -> int:
    """Ranks in the default process group (1 without an initialised one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def gather_rows(local: torch.Tensor, width: int, group: dist.ProcessGroup | None = None
                ) -> tuple[torch.Tensor, list[int]]:
    """All ranks' ``[B_r, T_r, *rest]`` tensors as one ``[sum B_r, width, *rest]`` tensor, in
    rank order (``rest``, e.g. the K of a top-k field, is the same on every rank).

    Columns past a rank's ``T_r`` are zero (False for bool). Returns the tensor and every
    rank's row count. ``width`` must be >= every ``T_r`` (the max over ranks).
    """
    world = dist.get_world_size(group)
    rows = torch.tensor([local.shape[0]], device=local.device)
    counts = [torch.zeros_like(rows) for _ in range(world)]
    dist.all_gather(counts, rows, group=group)
    sizes = [int(c) for c in counts]
    padded = torch.zeros((max(sizes), width, *local.shape[2:]), dtype=local.dtype,
                         device=local.device)
    padded[: local.shape[0], : local.shape[1]] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)]), sizes


def batch_global_filter(token_filter: TokenFilter, signals: TokenSignals, *,
                        generator: torch.Generator | None = None,
                        group: dist.ProcessGroup | None = None) -> FilterResult:
    """Run ``token_filter`` over the signals of all ranks; return this rank's rows.

    ``signals`` are this rank's ``[B_r, T_r]``; the returned masks and weights have the same
    shape, and ``stats`` describe the global batch. Gradient-carrying fields are gathered
    detached (the filter never differentiates). Every rank must call this collectively.
    """
    if world_size() == 1:
        return token_filter(signals, generator=generator)
    length = torch.tensor([signals.valid.shape[1]], device=signals.valid.device)
    dist.all_reduce(length, op=dist.ReduceOp.MAX, group=group)
    width = int(length)
    fields = {}
    offset = sizes = None
    for f in dataclasses.fields(signals):
        value = getattr(signals, f.name)
        if value is None:
            continue
        fields[f.name], sizes = gather_rows(value.detach(), width, group)
    assert sizes is not None
    rank = dist.get_rank(group)
    offset = sum(sizes[:rank])
    rows = slice(offset, offset + sizes[rank])
    result = token_filter(TokenSignals(**fields), generator=generator)
    cols = slice(0, signals.valid.shape[1])
    return FilterResult(keep=result.keep[rows, cols], filtered=result.filtered[rows, cols],
                        weights=result.weights[rows, cols], stats=result.stats)
