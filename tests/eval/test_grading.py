"""Grading under a deadline (saopd.eval.grading): timers and profile hooks, threads, the worker
pool (timeouts, stuck or dead workers, bad golds) and grading inside a parallel sweep worker."""

from __future__ import annotations

import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from saopd.eval import grading
from saopd.eval.grading import grade, grade_detailed, grade_many, grade_many_detailed
from saopd.eval.math import GoldAnswerError
from tests.eval.test_math import HARD_CASES, boxed


def test_grading_leaves_no_timer_or_hook_behind() -> None:
    def outer(*_: object) -> None:
        raise AssertionError("the outer timer must not fire during this test")

    old = signal.signal(signal.SIGALRM, outer)
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        assert grade(boxed("\\frac{2}{4}"), "\\frac12") is True
        assert signal.getsignal(signal.SIGALRM) is outer
        left, _ = signal.setitimer(signal.ITIMER_REAL, 0)
        assert 25.0 < left <= 30.0  # the caller's timer was re-armed
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    with ThreadPoolExecutor(max_workers=1) as pool:
        assert pool.submit(grade, boxed("1"), "1").result() is True
        assert pool.submit(sys.getprofile).result() is None


# An equation pair that SymPy takes several seconds to decide (found on MinervaMATH golds): 10.5 s
# of CPU on the 2-core development machine. The timeout tests bound this process's CPU time, not
# the wall clock, which a loaded machine stretches (1.8 s of wall for a 0.3-s timeout, once).
SLOW_RESPONSE = boxed("m l \\ddot{\\theta}(t)-m g \\sin \\theta(t)=f(t) \\cos \\theta(t)")
SLOW_GOLD = "SRAC=LRAC"


def test_timeout_in_main_thread_counts_as_wrong() -> None:
    start = time.process_time()
    result = grade_detailed(SLOW_RESPONSE, SLOW_GOLD, timeout_s=0.3)
    assert result.timed_out and not result.correct
    assert time.process_time() - start < 1.5


def test_grade_from_threads_matches_sequential_and_times_out() -> None:
    responses = [c[0] for c in HARD_CASES]
    golds = [c[1] for c in HARD_CASES]
    sequential = [grade(r, g) for r, g in zip(responses, golds, strict=True)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        threaded = list(pool.map(grade, responses, golds))
        slow = pool.submit(grade_detailed, SLOW_RESPONSE, SLOW_GOLD, timeout_s=0.3)
        start = time.process_time()
        slow_result = slow.result()
        elapsed = time.process_time() - start
    assert threaded == sequential == [c[2] for c in HARD_CASES]
    assert slow_result.timed_out and not slow_result.correct
    assert elapsed < 3.0


def test_grade_many_matches_sequential() -> None:
    pairs = [(c[0], c[1]) for c in HARD_CASES] + [("no answer", "5"), (None, "5")]
    sequential = [grade(r, g) for r, g in pairs]
    assert grade_many(pairs, workers=2, chunk_size=7) == sequential
    assert grade_many([], workers=2) == []


def test_grade_many_counts_timeouts_and_raises_on_bad_gold() -> None:
    pairs = [(boxed("5"), "5"), (SLOW_RESPONSE, SLOW_GOLD), (boxed("6"), "5")]
    results = grade_many_detailed(pairs, workers=2, timeout_s=0.3, chunk_size=1)
    assert [r.correct for r in results] == [True, False, False]
    assert [r.timed_out for r in results] == [False, True, False]
    with pytest.raises(GoldAnswerError, match="'\\?\\?\\?'"):
        grade_many([(boxed("5"), "5"), (boxed("5"), "???")], workers=2)


def _misbehave(gold: object, answer: str) -> bool:
    """Stands in for SymPy stuck in C code (GIL held, no signal handler runs) or crashing."""
    if answer == "hang":
        return sum(range(10**12)) > 0
    if answer == "crash":
        os._exit(1)
    return answer == "5"


@pytest.mark.parametrize("trouble", ["hang", "crash"])
def test_grade_many_replaces_a_stuck_or_dead_worker(monkeypatch: pytest.MonkeyPatch,
                                                     trouble: str) -> None:
    monkeypatch.setattr(grading, "answer_matches", _misbehave)  # inherited by forked workers
    pairs = [(boxed("5"), "5"), (boxed(trouble), "5"), (boxed("5"), "5"), (boxed("4"), "5"),
             (boxed("5"), "5")]
    start = time.perf_counter()
    results = grade_many_detailed(pairs, workers=1, timeout_s=0.5, chunk_size=4,
                                  mp_context="fork")
    assert time.perf_counter() - start < 15
    assert [r.correct for r in results] == [True, False, True, False, True]
    assert [r.timed_out for r in results] == [False, True, False, False, False]


def _grade_in_loky_worker() -> list[bool]:
    return grade_many([("\\boxed{2}", "2"), ("\\boxed{3}", "2")], workers=1)


def test_grading_inside_a_parallel_sweep_worker() -> None:
    """joblib's loky workers (hydra/launcher=joblib) cannot start spawn/forkserver children:
    grading falls back to the worker's own process instead of failing the sweep job."""
    from joblib import Parallel, delayed

    out = Parallel(n_jobs=2, backend="loky")(delayed(_grade_in_loky_worker)() for _ in range(1))
    assert out == [[True, False]]
