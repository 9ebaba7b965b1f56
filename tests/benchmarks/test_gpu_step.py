"""experiments/benchmarks/gpu_step.py --small: the GPU benchmark's code path, run on the CPU with
tiny shapes, prints one JSON line whose phases add up to the step it timed from outside."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

PHASES = ("rollout", "contexts", "teacher_full", "residual", "student_forward_filter_loss",
          "backward", "optimizer")


@pytest.mark.slow
def test_gpu_step_small_runs_on_cpu_and_reports_every_phase(tmp_path):
    out = tmp_path / "gpu_step.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "experiments/benchmarks/gpu_step.py"), "--small",
         "--steps", "2", "--check", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1  # one JSON line on stdout (progress goes to stderr)
    report = json.loads(lines[0])
    assert report == json.loads(out.read_text())
    assert report["small"] is True and report["device"].startswith("cpu")
    assert report["timed_steps"] == 2 and not report["stopped_early"]
    opd, sa = report["methods"]["opd"], report["methods"]["sa_opd"]
    for rec in (opd, sa):
        assert set(rec["phases_s"]) == set(PHASES)
        assert all(v >= 0 for v in rec["phases_s"].values())
        assert len(rec["step_times_s"]) == 3  # warm-up + 2 timed
        # the phases partition the step: their sum is the step timed around the whole call,
        # less only the bookkeeping between the timer's ticks (a few percent at most)
        assert rec["phases_sum_s"] <= rec["wall_step_s"] * 1.001
        assert rec["phases_sum_s"] >= 0.9 * rec["wall_step_s"]
        assert 0 < rec["sampled_tokens_per_step"] <= 4 * 8  # 4 prompts x 8 new tokens
        assert rec["sampled_tokens_per_s"] > 0 and rec["scoring_tflops_per_s"] > 0
        assert rec["peak_gpu_gib"] is None and rec["scoring_mfu"] is None  # no GPU, no peak
        # the split frozen passes equal score_frozen's, bit for bit on one device
        assert rec["frozen_check_max_abs_diff"] == 0.0
    # only SA-OPD runs the residual passes and filters tokens
    assert opd["phases_s"]["residual"] < 0.01 * opd["step_s"]
    assert sa["phases_s"]["residual"] > 0.05 * sa["phases_s"]["teacher_full"]
    assert opd["filtered_fraction"] == 0.0 and 0 < sa["filtered_fraction"] < 1
    assert report["sa_opd_over_opd"] == pytest.approx(sa["step_s"] / opd["step_s"], rel=1e-12)
    assert report["time_to_first_step_s"] >= report["load_s"] > 0
    assert report["model_bytes"]["student"] > 0 and report["model_bytes"]["teacher"] > 0
