"""Two gloo ranks, each holding part of a batch, select exactly what one process selects."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from saopd.filters import FILTERS, TokenFilter
from saopd.filters.distributed import batch_global_filter
from saopd.models.tiny import tiny_tokenizer
from saopd.signals import TokenSignals
from tests.conftest import random_signals
from tests.signals.topk_data import with_topk

CASES = {
    "sa_opd": {"p1": 0.3, "p2": 0.4},
    "sa_opd_bounded": {"p1": 0.3, "p2": 0.4, "beta_min": 0.2, "beta_max": 0.25,
                       "extreme": "two_sided"},
    **{name: {} for name in FILTERS.names() if name != "sa_opd"},
}
NARROW = 6  # rank 1's rows are valid only in the first 6 columns: it holds a narrower tensor


def bound(name: str, **params: object) -> TokenFilter:
    """The filter as the training module holds it (names resolved to the tiny tokenizer's ids)."""
    token_filter = FILTERS.build(name, **params)
    token_filter.bind_tokenizer(tiny_tokenizer())
    return token_filter


def global_batch() -> TokenSignals:
    s = with_topk(random_signals(5, 10, seed=7, valid_p=0.85), seed=7)  # [B, T, K] fields too
    valid = s.valid.clone()
    valid[3:, NARROW:] = False
    import dataclasses

    return dataclasses.replace(s, valid=valid)


def local_part(s: TokenSignals, rank: int) -> TokenSignals:
    import dataclasses

    rows, cols = (slice(0, 3), slice(None)) if rank == 0 else (slice(3, 5), slice(0, NARROW))
    return TokenSignals(**{f.name: getattr(s, f.name)[rows, cols]
                           for f in dataclasses.fields(s) if getattr(s, f.name) is not None})


def _worker(rank: int, init: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        part = local_part(global_batch(), rank)
        results = {}
        for case, params in CASES.items():
            name = "sa_opd" if case.startswith("sa_opd") else case
            res = batch_global_filter(bound(name, **params), part,
                                      generator=torch.Generator().manual_seed(3))
            results[case] = (res.keep, res.weights, res.stats)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_select_what_one_process_selects(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(f"file://{tmp_path / 'init'}", str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    whole = global_batch()
    for case, params in CASES.items():
        name = "sa_opd" if case.startswith("sa_opd") else case
        ref = bound(name, **params)(whole, generator=torch.Generator().manual_seed(3))
        keep0, w0, stats0 = ranks[0][case]
        keep1, w1, stats1 = ranks[1][case]
        assert keep0.shape == (3, 10) and keep1.shape == (2, NARROW)
        assert torch.equal(keep0, ref.keep[:3]), case
        assert torch.equal(keep1, ref.keep[3:, :NARROW]), case
        assert not ref.keep[3:, NARROW:].any()
        torch.testing.assert_close(w0, ref.weights[:3], rtol=0, atol=0)
        torch.testing.assert_close(w1, ref.weights[3:, :NARROW], rtol=0, atol=0)
        assert stats0 == stats1 == ref.stats, case  # global statistics on every rank
    # the comparison is not vacuous: SA-OPD filtered tokens on both ranks' rows
    filtered = whole.valid & ~torch.cat([ranks[0]["sa_opd"][0],
                                         torch.nn.functional.pad(ranks[1]["sa_opd"][0],
                                                                 (0, 10 - NARROW))])
    assert filtered[:3].any() and filtered[3:].any()


def test_single_process_falls_back_to_the_local_filter() -> None:
    s = global_batch()
    local = batch_global_filter(FILTERS.build("sa_opd"), s)
    assert torch.equal(local.keep, FILTERS.build("sa_opd")(s).keep)
