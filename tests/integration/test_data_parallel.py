"""DDP and FSDP2 (ModelParallelStrategy) over gloo with 2 CPU processes equal one process.

Each run is `dist_worker.py` in a subprocess (Lightning re-launches it for rank 1) on the same
fixed global batch of rollouts. The filter is batch-global and the loss normalised by global
counts, so the logged loss/FLMR and the student's updated weights must match the single-process
run. AdamW's eps is set to 1 (lr 0.05) and clipping off so that the update depends on the
gradient's *scale* (with a tiny eps AdamW is scale-invariant and would hide a mis-normalised
loss).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("dist_worker.py")
SENSITIVE = ("optim.eps=1.0", "optim.grad_clip=null", "optim.lr=0.05")

pytestmark = pytest.mark.slow


def run_worker(out: Path, strategy: str, devices: int, *extra: str) -> tuple:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(WORKER), str(out), strategy, str(devices),
                           *SENSITIVE, *extra], env=env, capture_output=True, text=True,
                          timeout=600, cwd=WORKER.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses = json.loads((out / "losses.json").read_text())
    state = torch.load(out / "run" / "checkpoints" / "last.ckpt", map_location="cpu",
                       weights_only=False)["state_dict"]
    initial = out / "initial_student.pt"
    return losses, state, torch.load(initial) if initial.is_file() else None


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    return run_worker(tmp_path_factory.mktemp("single"), "auto", 1)


def assert_same_run(got: tuple, ref: tuple) -> None:
    (losses, state, _), (ref_losses, ref_state, _) = got, ref
    assert len(losses) == len(ref_losses) == 2
    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert a["filtered_ratio"] == b["filtered_ratio"], step  # the same tokens were filtered
        assert a["flmr"] == pytest.approx(b["flmr"], rel=1e-5), step
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7), step
    assert sorted(state) == sorted(ref_state)
    assert all(k.startswith("student.") for k in state)  # the teacher is never saved
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_single_process_run_moves_the_weights(single) -> None:
    """Guards the comparisons below: two steps move the student far beyond their tolerance."""
    losses, state, initial = single
    assert losses[0]["filtered_ratio"] > 0  # SA-OPD filtered something: the filter matters
    moved = max((state[k].float() - v.float()).abs().max().item() for k, v in initial.items())
    assert moved > 100 * 1e-6


@pytest.mark.parametrize("strategy,extra", [
    ("ddp", ()),
    ("ddp", ("step.micro_batch_size=1",)),
    ("fsdp", ()),
])
def test_two_ranks_equal_one_process(single, tmp_path: Path, strategy: str,
                                     extra: tuple[str, ...]) -> None:
    assert_same_run(run_worker(tmp_path, strategy, 2, *extra), single)
