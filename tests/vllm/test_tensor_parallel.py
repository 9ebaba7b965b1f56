"""The parts of tensor-parallel colocated vLLM engines that need no vLLM: the group layout
(consecutive ranks, within a node), the gather of a group's requests (every rank gets every
rank's prompts and seeds, in rank order; unseeded sampling gets one seed the group shares), and,
over 4 gloo ranks with tensor parallelism 2, the subgroups and the slice each rank keeps of its
group's rollouts. The engine itself runs on real vLLM in tests/integration/vllm/
(test_vllm_ranks.py, test_vllm_tensor_parallel_startup.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from saopd.rollout import SamplingParams
from saopd.rollout.base import RolloutBatch
from saopd.vllm.engine import VLLMEngine
from saopd.vllm.tp import TensorParallelGroup, gather_group_requests, tensor_parallel_groups
from tests.helpers.net import free_port


def test_groups_are_consecutive_ranks_within_a_node() -> None:
    assert tensor_parallel_groups(2, 2) == [[0, 1]]
    assert tensor_parallel_groups(4, 2) == [[0, 1], [2, 3]]
    assert tensor_parallel_groups(8, 4, ranks_per_node=8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert tensor_parallel_groups(16, 8, ranks_per_node=8)[1] == list(range(8, 16))
    assert tensor_parallel_groups(3, 1) == [[0], [1], [2]]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide the number of "
                                         r"training processes \(3\)"):
        tensor_parallel_groups(3, 2)
    with pytest.raises(ValueError, match=r"per node \(2\).*stays within a node"):
        tensor_parallel_groups(4, 4, ranks_per_node=2)  # a group would span two nodes
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        tensor_parallel_groups(4, 0)


CHATS = [[[{"role": "user", "content": f"rank {r} prompt {i}"}] for i in range(2)]
         for r in range(2)]


def test_a_group_gathers_every_ranks_prompts_and_seeds_in_rank_order() -> None:
    sent = [(CHATS[0], SamplingParams(n=2, seed=10)), (CHATS[1], SamplingParams(n=2, seed=99))]
    got = gather_group_requests(CHATS[1], sent[1][1], lambda obj: [sent[0], obj])
    assert got == [(CHATS[0], sent[0][1]), (CHATS[1], sent[1][1])]  # seeds kept per rank


def test_unseeded_sampling_gets_one_seed_the_group_shares() -> None:
    box: list = []

    def gather(obj):  # both ranks see the object the other sent: one seed per segment
        box.append(obj)
        return [obj, obj]

    got = gather_group_requests(CHATS[0], SamplingParams(seed=None), gather)
    assert isinstance(got[0][1].seed, int) and got[0][1].seed == box[0][1].seed
    with pytest.raises(TypeError, match="not SamplingParams"):
        gather_group_requests(CHATS[0], SamplingParams(seed=1), lambda obj: [(CHATS[0], 3)])


def test_a_shard_needs_an_in_process_tensor_parallel_engine(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="colocated_tensor_parallel needs in_process=True"):
        VLLMEngine(tmp_path, object(), colocated_tensor_parallel=True, tensor_parallel_size=2,
                   in_process=False)
    with pytest.raises(ValueError, match="colocated_tensor_parallel needs"):
        VLLMEngine(tmp_path, object(), colocated_tensor_parallel=True, tensor_parallel_size=1)


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    try:
        tp = TensorParallelGroup.create(2, timeout=60.0)
        # an engine whose vLLM is stubbed: one batch per segment, tagged with its prompts
        engine = object.__new__(VLLMEngine)
        engine.__dict__["llm"] = object()  # started
        engine._tp = tp
        segments_seen: list = []

        def fake_segments(segments):
            segments_seen.extend([[m[0]["content"] for m in chats], sampling.seed]
                                 for chats, sampling in segments)
            return [RolloutBatch(messages=chats) for chats, _ in segments]

        engine._generate_segments = fake_segments
        mine = [[{"role": "user", "content": f"r{rank} p{i}"}] for i in range(rank + 1)]
        batch = engine.generate(mine, SamplingParams(seed=1000 * rank))
        Path(out, f"rank{rank}.json").write_text(json.dumps({
            "ranks": tp.ranks, "index": tp.index, "kept": [m[0]["content"]
                                                           for m in batch.messages],
            "segments": segments_seen}))
        tp.destroy()
    finally:
        dist.destroy_process_group()


def test_four_ranks_at_tensor_parallel_2_gather_within_their_group_and_keep_their_rows(
        tmp_path: Path) -> None:
    mp.start_processes(_rank, args=(free_port(), str(tmp_path)), nprocs=4, join=True,
                       start_method="spawn")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [g["ranks"] for g in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["index"] for g in got] == [0, 1, 0, 1]
    for r, g in enumerate(got):  # each rank keeps its own prompts, in order
        assert g["kept"] == [f"r{r} p{i}" for i in range(r + 1)]
    # the two ranks of a group submit the same segments (rank order, each rank's seed)
    assert got[0]["segments"] == got[1]["segments"] == [[["r0 p0"], 0],
                                                         [["r1 p0", "r1 p1"], 1000]]
    assert got[2]["segments"] == got[3]["segments"] == [
        [["r2 p0", "r2 p1", "r2 p2"], 2000], [["r3 p0", "r3 p1", "r3 p2", "r3 p3"], 3000]]


def _absent_peer(rank: int, port: int, out: str) -> None:
    import time

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        if rank == 0:
            started = time.perf_counter()
            try:
                TensorParallelGroup.create(2, timeout=3.0, where=" (test)")
                message = "no error"
            except RuntimeError as err:
                message = str(err)
            Path(out, "rank0.json").write_text(json.dumps(
                {"error": message, "seconds": time.perf_counter() - started}))
        else:  # never starts its shard; waits for rank 0 to be done
            dist.barrier()
            return
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_rank_that_never_checks_in_is_named_within_the_timeout(tmp_path: Path) -> None:
    mp.start_processes(_absent_peer, args=(free_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    got = json.loads((tmp_path / "rank0.json").read_text())
    assert got["error"].startswith("the vLLM engine (test): ranks [1] did not come to start "
                                   "their shards within rollout.startup_timeout = 3 s"), got
    assert 3.0 <= got["seconds"] < 30.0
