"""Colocated vLLM engines under 2 gloo training ranks (DDP, FSDP2) equal one process.

Each run is dist_vllm_worker.py in a subprocess (Lightning re-launches it for rank 1), every
rank with its own vLLM engine (out of process, a clean environment, its own model folder), or,
with ``rollout.tensor_parallel_size=2``, both ranks sharing one engine sharded over them (vLLM's
external launcher, in the training processes: each rank holds half of the embedding, the
ranks gather their prompts, both submit all of them and keep their own rows).
Greedy rollouts depend only on the student's weights and the prompt, so the two ranks' samples,
concatenated in rank order, must equal one process's at every step (step 2 samples from the
weights synced after step 1: a rank whose engine missed the sync would differ), and after 2
steps the student must equal the one-process run's (the data-parallel parity tolerance).
Each 2-rank run (one engine per rank, or one shared over the ranks; DDP or FSDP2) is started
once for the module (a run costs minutes on a 2-core CPU) and read by every test that needs it:
the DDP runs also sample their step-0 prompts with n=2 at temperature 1, the draws the seeded
test compares.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

WORKER = Path(__file__).with_name("dist_vllm_worker.py")


def run_worker(out: Path, strategy: str, devices: int, *extra: str) -> tuple[list, list, dict]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(WORKER), str(out), strategy, str(devices), *extra],
                          env=env, capture_output=True, text=True, timeout=900,
                          cwd=WORKER.parent)
    assert proc.returncode == 0, proc.stderr[-6000:]
    rollouts = [json.loads((out / f"rollouts_rank{r}.json").read_text())
                for r in range(devices)]
    steps = []
    for k in range(len(rollouts[0])):  # rank 0's rows, then rank 1's: the global batch
        steps.append({key: [x for rank in rollouts for x in rank[k][key]]
                      for key in ("messages", "responses")})
    losses = json.loads((out / "losses.json").read_text())
    state = torch.load(out / "run" / "checkpoints" / "last.ckpt", map_location="cpu",
                       weights_only=False)["state_dict"]
    return steps, losses, state


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    return run_worker(tmp_path_factory.mktemp("single"), "auto", 1)


TP = ("rollout.tensor_parallel_size=2",)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, tuple]]:
    """``two_ranks(strategy, *overrides)``: the folder and result of that 2-rank run, each run
    once for the module."""
    runs: dict[tuple[str, ...], tuple[Path, tuple]] = {}

    def get(strategy: str, *extra: str) -> tuple[Path, tuple]:
        key = (strategy, *extra)
        if key not in runs:
            out = tmp_path_factory.mktemp(f"{strategy}-{'tp' if extra else 'own'}")
            runs[key] = (out, run_worker(out, strategy, 2, *extra))
        return runs[key]

    return get


def _assert_equal_runs(run: tuple, single: tuple) -> None:
    steps, losses, state = run
    ref_steps, ref_losses, ref_state = single
    assert len(steps) == len(ref_steps) == 2
    for k, (got, ref) in enumerate(zip(steps, ref_steps, strict=True)):
        assert got["messages"] == ref["messages"], k  # the same prompts, split over the ranks
        assert got["responses"] == ref["responses"], k  # ... and the same greedy samples
    # the second step's samples come from the synced weights: they differ from the first's
    assert ref_steps[0]["responses"] != ref_steps[1]["responses"] or \
        ref_steps[0]["messages"] != ref_steps[1]["messages"]
    for k, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert a["filtered_ratio"] == b["filtered_ratio"], k
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7), k
    assert sorted(state) == sorted(ref_state)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_with_their_own_engines_equal_one_process(single, two_ranks,
                                                            strategy: str) -> None:
    out, run = two_ranks(strategy)
    _assert_equal_runs(run, single)
    # on vLLM's CPU backend each rank's engine worker runs on the rank's own share of the CPUs
    # (vLLM's default bound both to the same first core)
    from saopd.vllm.runtime import cpu_threads_bind

    for r in range(2):
        info = json.loads((out / f"engine_rank{r}.json").read_text())
        bind = cpu_threads_bind(r, 2, info["allowed_cpus"])
        if bind != "nobind":
            assert [int(c) for c in bind.split(",")] in info["descendant_cpus"], (r, info)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_sharing_one_tensor_parallel_engine_equal_one_process(
        single, two_ranks, strategy: str) -> None:
    out, run = two_ranks(strategy, *TP)
    engines = [json.loads((out / f"engine_rank{r}.json").read_text()) for r in range(2)]
    for info in engines:  # one engine over both ranks: each holds half of the vocabulary rows
        assert info["colocated_tensor_parallel"] and info["vllm_tensor_parallel_size"] == 2
        assert info["embed_rows"] * 2 >= info["vocab_size"] > info["embed_rows"]
        assert info["sync_checked"] > 0  # the norms (replicated) were compared after each sync
    _assert_equal_runs(run, single)


def _sampled(out: Path) -> dict[str, list]:
    """Step 0's sampled draws of a 2-rank run, rank 0's rows then rank 1's."""
    ranks = [json.loads((out / f"sampled_rank{r}.json").read_text()) for r in range(2)]
    return {key: [x for rank in ranks for x in rank[key]] for key in ("messages", "responses")}


def test_seeded_sampling_through_a_shared_engine_equals_one_engine_per_rank(two_ranks) -> None:
    # rank r's prompt i is sampled with the seed its own engine gives it, inside the group's
    # one generate call: the same samples as one engine per rank (step 0: the same weights;
    # later steps also agreed here, but depend on the kernels' rounding under tensor
    # parallelism)
    own = _sampled(two_ranks("ddp")[0])
    shared = _sampled(two_ranks("ddp", *TP)[0])
    assert own["messages"] == shared["messages"]
    assert len(own["responses"]) == 8  # 4 prompts x n=2
    assert own["responses"] == shared["responses"]
