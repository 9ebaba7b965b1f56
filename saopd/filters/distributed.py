"""Batch-global filtering when a step's rollouts are split across data-parallel ranks.

SA-OPD's Bottom_p1 / Top_p2 selections and FLMR are defined over the valid tokens of the whole
batch (paper Eq. 16-17). When each rank holds only its share of the rollouts, every rank gathers
the detached signals the filter reads from all ranks, runs the filter on the global batch (the
same computation on every rank) and keeps the rows that are its own. Because rows are
concatenated in rank order and filters are padding-invariant (ranks are taken over the compact
valid tokens, row-major), N ranks select exactly the tokens one process selects for the
concatenated batch, and the statistics (FLMR, filtered ratio, alpha) are the global ones.

The rank, world size and collectives come from :mod:`saopd.data_parallel`; with no initialised
process group (or one rank) the filter runs locally.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from saopd.data_parallel import all_reduce_max, gather_rows, rank, world_size
from saopd.filters.base import FilterResult, TokenFilter
from saopd.signals.token_signals import TokenSignals


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
    width = int(all_reduce_max(length, group))
    fields = {}
    offset = sizes = None
    for f in dataclasses.fields(signals):
        value = getattr(signals, f.name)
        if value is None:
            continue
        fields[f.name], sizes = gather_rows(value.detach(), width, group)
    assert sizes is not None
    me = rank(group)
    offset = sum(sizes[:me])
    rows = slice(offset, offset + sizes[me])
    result = token_filter(TokenSignals(**fields), generator=generator)
    cols = slice(0, signals.valid.shape[1])
    return FilterResult(keep=result.keep[rows, cols], filtered=result.filtered[rows, cols],
                        weights=result.weights[rows, cols], stats=result.stats)
