"""A training run under ``trainer.strategy=fsdp`` builds its models on the meta device and fills
their shards after sharding (:func:`saopd.models.sharding.materialize_sharded`), on both ranks,
student and teacher; its two steps log the same losses and leave the same student weights as one
process that built the models whole (the harness and tolerances of
tests/integration/test_data_parallel.py, whose worker this one wraps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.test_data_parallel import SENSITIVE, assert_same_run

WORKER = Path(__file__).with_name("fsdp_meta_worker.py")


def run(out: Path, strategy: str, devices: int) -> tuple:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(WORKER), str(out), strategy, str(devices),
                           *SENSITIVE], env=env, capture_output=True, text=True, timeout=600,
                          cwd=WORKER.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses = json.loads((out / "losses.json").read_text())
    state = torch.load(out / "run" / "checkpoints" / "last.ckpt", map_location="cpu",
                       weights_only=False)["state_dict"]
    return losses, state, None


@pytest.mark.slow
def test_fsdp_run_fills_meta_models_and_steps_as_one_process(tmp_path: Path) -> None:
    single = run(tmp_path / "single", "auto", 1)
    assert not list((tmp_path / "single").glob("materialized_rank*.json"))  # built whole
    sharded = run(tmp_path / "fsdp", "fsdp", 2)
    for rank in (0, 1):
        filled = json.loads((tmp_path / "fsdp" / f"materialized_rank{rank}.json").read_text())
        assert filled == ["FSDPQwen3ForCausalLM"] * 2  # student, teacher (sharded)
    assert_same_run(sharded, single)
