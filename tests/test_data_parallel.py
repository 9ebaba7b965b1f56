"""saopd.data_parallel: the rank / world-size facts and the collectives, alone (one process, no
group), from the launcher's variables, and over two gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from saopd import data_parallel as dp

LAUNCHER = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK")


def test_one_process_is_rank_zero_of_one_and_collectives_return_their_input() -> None:
    assert not dp.is_distributed()
    assert (dp.rank(), dp.world_size()) == (0, 1)
    x = torch.tensor([1.0, -2.0], requires_grad=True)
    assert dp.all_reduce_sum(x) is x and dp.all_reduce_max(x) is x
    local = torch.arange(6).view(2, 3)
    rows, sizes = dp.gather_rows(local, 5)
    assert sizes == [2] and rows.shape == (2, 5)
    assert torch.equal(rows[:, :3], local) and not rows[:, 3:].any()


def test_training_rank_and_world_size_from_the_launcher(monkeypatch) -> None:
    for key in LAUNCHER:
        monkeypatch.delenv(key, raising=False)
    assert dp.training_rank() == (0, 0) and dp.training_world_size() == 1
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert dp.training_rank() == (5, 1) and dp.training_world_size() == 8
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("NODE_RANK", "2")
    assert dp.training_rank() == (9, 1)  # Lightning's launch: node 2 x 4 per node + local 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert dp.training_rank() == (1, 1)  # no per-node count: the local rank


def _worker(rank: int, init: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        # rank 0 holds 3 rows of width 4, rank 1 holds 1 row of width 2 (bool: padded False)
        local = torch.full((3, 4) if rank == 0 else (1, 2), True)
        values = torch.tensor([float(rank + 1), -float(rank)])
        out = {
            "facts": (dp.is_distributed(), dp.rank(), dp.world_size(), dp.training_rank()[0],
                      dp.training_world_size()),
            "sum": dp.all_reduce_sum(values), "max": dp.all_reduce_max(values),
            "unchanged": values.clone(), "gather": dp.gather_rows(local, 4),
        }
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_agree_on_sums_maxima_and_gathered_rows(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(f"file://{tmp_path / 'init'}", str(tmp_path)), nprocs=2, join=True)
    for r in (0, 1):
        out = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        assert out["facts"] == (True, r, 2, r, 2)
        assert torch.equal(out["sum"], torch.tensor([3.0, -1.0]))
        assert torch.equal(out["max"], torch.tensor([2.0, 0.0]))
        assert torch.equal(out["unchanged"], torch.tensor([float(r + 1), -float(r)]))
        rows, sizes = out["gather"]
        assert sizes == [3, 1] and rows.shape == (4, 4) and rows.dtype == torch.bool
        assert rows[:3].all() and rows[3, :2].all() and not rows[3, 2:].any()
