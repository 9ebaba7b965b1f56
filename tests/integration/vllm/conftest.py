"""Runs shared by the real-vLLM test modules (`make test-vllm`): each starts vLLM engines that
cost tens of seconds on a 2-core CPU, so one run serves every test that reads it."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from tests.conftest import compose_train

HERE = Path(__file__).parent
#: The order this suite's modules run in. CI runs the suite beside the main one and it ends
#: last, alone: the modules that mostly wait (start-up deadlines, one engine at a time) go first,
#: while the main suite keeps the cores busy anyway, and those whose runs keep both cores busy
#: (two servers, two training ranks each with an engine) last. A module not listed runs before
#: all of them (test_module_order.py says to list it).
MODULE_ORDER = ("test_module_order", "test_vllm_tensor_parallel_startup", "test_vllm_vlm",
                "test_vllm_engine", "test_cpu_memory", "test_teacher_scoring",
                "test_hostile_servers", "test_vllm_server", "test_vllm_ranks")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """This folder's tests in :data:`MODULE_ORDER` (each module's own order kept), in the
    places the collection gave them; every other test stays where it was."""
    slots = [i for i, item in enumerate(items) if item.path.parent == HERE]
    rank = {name: k for k, name in enumerate(MODULE_ORDER)}
    ours = sorted((items[i] for i in slots), key=lambda item: rank.get(item.path.stem, -1))
    for i, item in zip(slots, ours, strict=True):
        items[i] = item


class StepRecord(L.Callback):
    """Each step's filtered mask and loss, the model's teacher module, the teacher waits."""

    def __init__(self) -> None:
        self.steps: list[tuple[torch.Tensor, float]] = []
        self.teacher: Any = "unset"
        self.waits: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, *args: Any) -> None:
        m = trainer.callback_metrics
        self.steps.append((outputs["view"].filtered.clone(), float(m["train/loss"])))
        self.teacher = pl_module.teacher
        if "train/teacher_wait" in m:
            self.waits.append(float(m["train/teacher_wait"]))


@dataclasses.dataclass
class TeacherRuns:
    """``experiment=tiny`` for 3 steps with ``teacher_scoring=hf`` and with
    ``teacher_scoring=vllm`` given no memory option (eager only), on the same rollouts."""

    hf: StepRecord
    served: StepRecord
    served_summary: dict[str, Any]
    available_before: Any  # saopd.vllm.runtime.MemoryFigures | None, before the vLLM run
    kv_cache_bytes: list[int | None]  # what saopd sized the teacher's KV cache to, per call


def server_environ(index: int, count: int = 2) -> dict[str, str]:
    """The environment of test server ``index`` of ``count`` started side by side: one thread,
    offline, and its own share of the CPUs (vLLM's CPU default binds every server's worker to
    the same first core, so the servers' start-ups and requests queued on one core)."""
    from saopd.vllm.runtime import cpu_threads_bind

    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": cpu_threads_bind(index, count, os.sched_getaffinity(0))}


TINY_3_STEPS = ("experiment=tiny", "steps=3", "trainer.view_every_n_steps=0",
                "trainer.checkpoint_every_n_steps=3")


@pytest.fixture(scope="session")
def tiny_teacher_runs(tmp_path_factory: pytest.TempPathFactory) -> TeacherRuns:
    """The :class:`TeacherRuns`, run once for the session (the vLLM teacher's engine core in its
    own process, the default, starts in about half a minute here)."""
    import saopd.vllm.runtime as runtime
    import saopd.vllm.teacher as teacher_scoring
    from saopd.train import train

    root = tmp_path_factory.mktemp("tiny-teacher-runs")
    sized: list[int | None] = []

    def spy(*args: Any, **kwargs: Any) -> int | None:
        sized.append(runtime.cpu_kv_cache_bytes(*args, **kwargs))
        return sized[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        hf = StepRecord()
        train(compose_train(root / "hf", *TINY_3_STEPS, mlflow=False), extra_callbacks=[hf])
        mp.setattr(teacher_scoring, "cpu_kv_cache_bytes", spy)
        before = runtime.available_memory()
        served = StepRecord()
        # no kv_cache_gb, max_model_len or gpu_memory_utilization: eager only, to start fast
        summary = train(compose_train(root / "vllm", *TINY_3_STEPS, "teacher_scoring=vllm",
                                      "teacher_scoring.enforce_eager=true", mlflow=False),
                        extra_callbacks=[served])
    return TeacherRuns(hf=hf, served=served, served_summary=summary, available_before=before,
                       kv_cache_bytes=sized)

