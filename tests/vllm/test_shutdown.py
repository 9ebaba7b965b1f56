"""Shutting a vLLM engine down (saopd.vllm.shutdown): the engine core always, then only as much
of torch.distributed as asked. vLLM's parallel_state is faked (the real engines:
tests/integration/vllm)."""

from __future__ import annotations

import sys
import threading
import types
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest

from saopd.vllm.shutdown import TEARDOWNS, Closing, remove_folder, shutdown_llm, stop_pool


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, name: str, fail: bool = False) -> Any:
        def record() -> None:
            self.calls.append(name)
            if fail:
                raise RuntimeError(f"{name} failed")

        return record


def _fake_vllm(monkeypatch: pytest.MonkeyPatch, calls: _Recorder) -> types.ModuleType:
    state = types.ModuleType("vllm.distributed.parallel_state")
    state.destroy_model_parallel = calls("destroy_model_parallel")
    state.destroy_distributed_environment = calls("destroy_distributed_environment")
    state._WORLD = SimpleNamespace(destroy=calls("world.destroy"))
    distributed = types.ModuleType("vllm.distributed")
    distributed.parallel_state = state
    vllm = types.ModuleType("vllm")
    vllm.distributed = distributed
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.distributed", distributed)
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", state)
    return state


def _llm(calls: _Recorder, fail: bool = False) -> Any:
    return SimpleNamespace(llm_engine=SimpleNamespace(
        engine_core=SimpleNamespace(shutdown=calls("core.shutdown", fail))))


@pytest.mark.parametrize(("distributed", "expected"), [
    ("none", ["core.shutdown"]),
    ("all", ["core.shutdown", "destroy_model_parallel", "destroy_distributed_environment"]),
    ("vllm_groups", ["core.shutdown", "destroy_model_parallel", "world.destroy"]),
])
def test_each_teardown_takes_down_what_it_names(monkeypatch, distributed: str,
                                                expected: list[str]) -> None:
    calls = _Recorder()
    state = _fake_vllm(monkeypatch, calls)
    shutdown_llm(_llm(calls), distributed=distributed)
    assert calls.calls == expected
    # only vllm_groups drops vLLM's world group (the trainer's default group stays)
    assert (state._WORLD is None) == (distributed == "vllm_groups")


def test_a_failing_core_shutdown_does_not_stop_the_teardown(monkeypatch) -> None:
    calls = _Recorder()
    _fake_vllm(monkeypatch, calls)
    shutdown_llm(_llm(calls, fail=True), distributed="all")
    assert calls.calls == ["core.shutdown", "destroy_model_parallel",
                           "destroy_distributed_environment"]


def test_an_engine_without_a_core_and_an_unknown_teardown(monkeypatch) -> None:
    calls = _Recorder()
    _fake_vllm(monkeypatch, calls)
    shutdown_llm(SimpleNamespace(llm_engine=SimpleNamespace()), distributed="vllm_groups")
    assert calls.calls == ["destroy_model_parallel", "world.destroy"]
    assert TEARDOWNS == ("none", "all", "vllm_groups")
    with pytest.raises(ValueError, match=r"distributed must be one of .*got 'some'"):
        shutdown_llm(_llm(calls), distributed="some")


class _Owner(Closing):
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_closing_closes_on_the_way_out_even_after_an_error() -> None:
    with _Owner() as owner:
        assert owner.closed == 0
    assert owner.closed == 1
    other = _Owner()
    with pytest.raises(KeyError), other:
        raise KeyError("inside")
    assert other.closed == 1
    with pytest.raises(NotImplementedError):
        Closing().close()


def test_stop_pool_waits_or_cancels_what_has_not_started() -> None:
    stop_pool(None, wait=True)  # nothing to stop
    release = threading.Event()
    pool = ThreadPoolExecutor(max_workers=1)
    running = pool.submit(release.wait, 30)
    queued = pool.submit(lambda: "ran")
    stop_pool(pool, wait=False)  # returns at once, the queued call cancelled
    assert queued.cancelled() and not running.done()
    release.set()
    assert running.result(timeout=30) is True
    pool = ThreadPoolExecutor(max_workers=1)
    done = [pool.submit(lambda i=i: i) for i in range(3)]
    stop_pool(pool, wait=True)  # every submitted call ran
    assert [f.result(timeout=0) for f in done] == [0, 1, 2]


def test_remove_folder_removes_a_tree_and_ignores_what_is_not_there(tmp_path) -> None:
    tree = tmp_path / "a"
    (tree / "b").mkdir(parents=True)
    (tree / "b" / "f.txt").write_text("x")
    remove_folder(tree)
    assert not tree.exists()
    remove_folder(tree)  # already gone: no error
    remove_folder(None)
