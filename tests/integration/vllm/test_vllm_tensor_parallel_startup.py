"""A tensor-parallel colocated vLLM engine (2 gloo ranks sharing one engine, vLLM's external
launcher in the training processes) starts, samples the same tokens on both ranks' shards,
and a start-up that cannot complete ends with a message, never a hang:

- a rank that never starts its shard: the other rank's start-up raises ``RuntimeError`` within
  ``startup_timeout`` (the ranks' rendezvous times out), naming the engine's ranks;
- a rank whose vLLM start fails after the ranks met: the other rank is stuck inside vLLM's own
  collectives, where no Python exception can reach it, and its watchdog ends the process
  (status 1) ``HARD_DEADLINE_GRACE`` (set to 5 s) after the timeout, with a message.

Each case is dist_tp_startup_worker.py, run as 2 processes (RANK 0 and 1).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

WORKER = Path(__file__).with_name("dist_tp_startup_worker.py")
ROOT = WORKER.parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(out: Path, mode: str, timeout: float) -> tuple[list[int], list[str], list, float]:
    port = _free_port()
    procs = []
    started = time.perf_counter()
    for rank in range(2):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), str(out), mode, str(timeout)], env=env, cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=timeout + 240)[0] for p in procs]
    seconds = time.perf_counter() - started
    records = [json.loads(f.read_text()) if (f := out / f"rank{r}.json").is_file() else None
               for r in range(2)]
    return [p.returncode for p in procs], logs, records, seconds


def test_both_shards_start_and_sample_the_same_tokens(tmp_path: Path) -> None:
    codes, logs, records, _ = run_ranks(tmp_path, "ok", 120.0)
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    # each rank keeps its own prompt's rows; a rank's engine sampled both ranks' prompts
    assert all(len(r["responses"]) == 1 and len(r["responses"][0]) >= 1 for r in records)
    assert "external_launcher" in logs[0] and "external_launcher" in logs[1]


def test_a_rank_that_never_starts_its_shard_is_a_clear_error(tmp_path: Path) -> None:
    # no rendezvous can happen, so the deadline need not leave room for one: 10 s
    codes, logs, records, _ = run_ranks(tmp_path, "absent", 10.0)
    assert records[0] is not None, logs[0][-3000:]
    assert records[0]["error"].startswith("RuntimeError: the vLLM engine (tensor parallel over "
                                          "ranks [0, 1]; this is rank 0)"), records[0]
    assert "rollout.startup_timeout = 10 s" in records[0]["error"]
    assert records[0]["seconds"] < 10 + 30
    assert codes[0] == 1 and records[1].get("slept")


def test_a_rank_whose_vllm_start_fails_ends_the_waiting_rank(tmp_path: Path) -> None:
    codes, logs, records, _ = run_ranks(tmp_path, "fails", 20.0)
    assert records[1] is not None and "max_model_len" in records[1]["error"], logs[1][-3000:]
    # rank 0 waits inside vLLM's collectives for rank 1: its watchdog ends it, with a message
    assert codes[0] == 1 and records[0] is None, logs[0][-3000:]
    assert ("the vLLM engine (tensor parallel over ranks [0, 1]; this is rank 0) did not start "
            "within rollout.startup_timeout = 20 s (+ 5 s)") in logs[0]
    assert "Stacks of every thread follow" in logs[0]
