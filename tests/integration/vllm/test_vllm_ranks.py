"""Colocated vLLM engines under 2 gloo training ranks (DDP, FSDP2) equal one process.

Each run is dist_vllm_worker.py in a subprocess (Lightning re-launches it for rank 1), every
rank with its own vLLM engine (out of process, a clean environment, its own model folder).
Greedy rollouts depend only on the student's weights and the prompt, so the two ranks' samples,
concatenated in rank order, must equal one process's at every step (step 2 samples from the
weights synced after step 1: a rank whose engine missed the sync would differ), and after 2
steps the student must equal the one-process run's (the data-parallel parity tolerance).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

WORKER = Path(__file__).with_name("dist_vllm_worker.py")


def run_worker(out: Path, strategy: str, devices: int) -> tuple[list, list, dict]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(WORKER), str(out), strategy, str(devices)],
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


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_with_their_own_engines_equal_one_process(single, tmp_path: Path,
                                                            strategy: str) -> None:
    steps, losses, state = run_worker(tmp_path, strategy, 2)
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
