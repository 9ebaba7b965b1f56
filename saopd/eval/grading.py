"""Grading math responses under a time limit, one at a time or many in worker processes.

:func:`grade_detailed` / :func:`grade` grade one response against its gold (extraction and
equality: :mod:`saopd.eval.math`) within one deadline; :func:`grade_many_detailed` /
:func:`grade_many` spread many ``(response, gold)`` pairs over a pool of processes that survives
stuck or crashing workers.

Time limits. math-verify's own timeouts are switched off (:mod:`saopd.eval.math`); one deadline
of ``timeout_s`` covers the whole grading of a response instead:

* in the main thread, a ``SIGALRM`` interval timer (any timer the caller had is re-armed after);
* in other threads, a per-thread profile hook (``sys.setprofile``) that raises once the deadline
  has passed, at the next Python or C function call. It slows grading in that thread about 2x and
  is skipped when a profiler is already installed in the thread (then there is no time limit).

If the timeout lands where Python discards exceptions (a ``__del__`` run by the garbage
collector), it is raised again every 0.25 s until it sticks. Neither mechanism can interrupt one
long C-level operation (SymPy computing ``10^{10^{10}}`` holds the GIL for minutes), so answers
that would make SymPy build astronomically large integers are unequal unparsed
(:mod:`saopd.eval.math`), and ``grade_many`` kills a worker process that has made no progress
for ``2 * timeout_s + 1`` seconds, counts the response it was grading as timed out, and carries
on with a fresh worker (likewise if a worker dies). A response that times out is graded wrong
and counted (``GradeResult.timed_out``).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import re
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from multiprocessing.connection import Connection, wait
from typing import Any, NamedTuple

from saopd.eval.habits import follows_shortcut
from saopd.eval.math import (
    MAX_ANSWER_CHARS,
    MAX_RESPONSE_CHARS,
    GoldAnswerError,
    answer_matches,
    extract_answer,
    prepare_gold,
)
from saopd.latex import last_boxed

__all__ = [
    "ExactGrade",
    "GradeResult",
    "grade",
    "grade_detailed",
    "grade_exact_phrases",
    "grade_many",
    "grade_many_detailed",
]

logger = logging.getLogger(__name__)


class GradeResult(NamedTuple):
    """The outcome of grading one response.

    Attributes:
        correct: whether the extracted answer matches the gold.
        answer: the extracted answer (``None`` if the response has none).
        timed_out: grading ran out of time (then ``correct`` is False).
    """

    correct: bool
    answer: str | None
    timed_out: bool = False


class _Timeout(BaseException):
    """Raised inside grading when its deadline passes (BaseException: nothing swallows it)."""



# --------------------------------------------------------------------------------------------
# Deadlines
# --------------------------------------------------------------------------------------------


_RETRY_S = 0.25
"""A timeout raised where Python discards it (in a finaliser) is raised again this much later."""
_NEVER = float("inf")


def _raise_timeout(*_: object) -> None:
    raise _Timeout()


@contextlib.contextmanager
def _alarm_deadline(seconds: float) -> Iterator[None]:
    """Main thread: SIGALRM interval timer; an outer timer and handler are restored after."""
    start = time.monotonic()
    old_handler = signal.signal(signal.SIGALRM, _raise_timeout)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds, _RETRY_S)
    try:
        yield
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:  # even if the timer fired just now
            signal.signal(signal.SIGALRM, old_handler)
            if old_delay > 0:  # re-arm the caller's timer with what is left of it
                left = max(old_delay - (time.monotonic() - start), 1e-3)
                signal.setitimer(signal.ITIMER_REAL, left, old_interval)


@contextlib.contextmanager
def _profile_deadline(seconds: float) -> Iterator[None]:
    """Any thread: a profile hook that raises at the first function call after the deadline."""
    if sys.getprofile() is not None:  # a profiler owns the hook: no limit rather than break it
        yield
        return
    clock = time.monotonic
    next_raise = [clock() + seconds]  # a list: disarming it must not be a call (see finally)

    def hook(frame: object, event: str, arg: object) -> None:
        if clock() > next_raise[0]:
            next_raise[0] = clock() + _RETRY_S
            raise _Timeout()

    sys.setprofile(hook)
    try:
        yield
    finally:
        next_raise[0] = _NEVER
        sys.setprofile(None)


def _deadline(seconds: float | None) -> contextlib.AbstractContextManager[None]:
    if seconds is None or seconds <= 0:
        return contextlib.nullcontext()
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        return _alarm_deadline(seconds)
    return _profile_deadline(seconds)


# --------------------------------------------------------------------------------------------
# Public grading API
# --------------------------------------------------------------------------------------------


def grade_detailed(response: str | None, gold: object, *, timeout_s: float | None = 5.0
                   ) -> GradeResult:
    """Grades one response and says what was extracted and whether time ran out.

    Args:
        response: the model's full response (anything that is not a string grades wrong).
        gold: the gold answer: a LaTeX string, a full solution ending in ``\\boxed{...}`` or
            GSM8K's ``#### 72``, an int, or an integer-valued float (AMC's ``27.0``).
        timeout_s: wall-clock limit for the whole grading (gold parsing included); ``None`` or
            ``<= 0`` for none. Works in any thread (see the module docstring).

    Raises:
        GoldAnswerError (a ValueError): the gold cannot be parsed at all (a dataset bug).
    """
    answer: str | None = None
    try:
        with _deadline(timeout_s):
            prepared = prepare_gold(gold)
            answer = extract_answer(response)
            if answer is None or len(answer) > MAX_ANSWER_CHARS:
                return GradeResult(False, answer)
            return GradeResult(answer_matches(prepared, answer), answer)
    except _Timeout:
        return GradeResult(False, answer, timed_out=True)
    except GoldAnswerError:
        raise
    except Exception:  # a bug in a parser must not stop an evaluation: the answer is wrong
        logger.debug("grading failed for answer %r", answer, exc_info=True)
        return GradeResult(False, answer)


def grade(response: str | None, gold: object, *, timeout_s: float | None = 5.0) -> bool:
    """Whether ``response``'s final answer equals ``gold`` (see :func:`grade_detailed`).

    Returns a plain bool; never raises on odd responses (empty, non-string, huge). A response that
    runs out of time is graded wrong. Raises ``GoldAnswerError`` (a ``ValueError`` naming the gold)
    when the gold cannot be parsed at all.
    """
    return grade_detailed(response, gold, timeout_s=timeout_s).correct


# --------------------------------------------------------------------------------------------
# Process pool
# --------------------------------------------------------------------------------------------


def _worker_main(conn: Connection, timeout_s: float | None) -> None:
    """Worker process: grades chunks in its main thread (alarm deadlines), a reply per response."""
    with contextlib.suppress(ValueError):  # not the main thread (e.g. embedded): nothing to do
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    conn.send(("ready",))
    while True:
        try:
            chunk = conn.recv()
        except EOFError:
            return
        if chunk is None:
            return
        for idx, response, gold in chunk:
            try:
                res = grade_detailed(response, gold, timeout_s=timeout_s)
                conn.send(("ok", idx, tuple(res)))
            except GoldAnswerError as exc:
                conn.send(("gold", idx, str(exc)))


def _default_context() -> mp.context.BaseContext:
    methods = mp.get_all_start_methods()
    if "forkserver" in methods:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        return ctx
    return mp.get_context("spawn")


class _Worker:
    """One worker process, its pipe, and the indices it still owes."""

    def __init__(self, ctx: mp.context.BaseContext, timeout_s: float | None) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, timeout_s), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.dead = False
        self.pending: deque[int] = deque()
        self.started = time.monotonic()
        self.last_progress = self.started

    def stop(self, *, kill: bool = False) -> None:
        if not kill:
            with contextlib.suppress(OSError, ValueError):
                self.conn.send(None)
            self.proc.join(timeout=2.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=2.0)
        self.conn.close()


def grade_many_detailed(
    pairs: Iterable[tuple[str | None, object]],
    *,
    workers: int | None = None,
    timeout_s: float | None = 5.0,
    chunk_size: int | None = None,
    mp_context: str | None = None,
    startup_timeout_s: float = 120.0,
) -> list[GradeResult]:
    """Grades ``(response, gold)`` pairs in worker processes; results in input order.

    Args:
        pairs: ``(response, gold)`` pairs, as for :func:`grade_detailed`.
        workers: number of processes (default: CPU count, at most one per chunk); ``0`` grades in
            this process instead (alarm/profile deadlines only, no kill of stuck C code).
        timeout_s: per-response limit, enforced by SIGALRM in each worker's main thread; a worker
            silent for ``2 * timeout_s + 1`` s is killed and that response counts as timed out.
        chunk_size: responses sent to a worker at once (default: up to 64, about 4 chunks/worker).
        mp_context: multiprocessing start method (default ``forkserver`` where available, with
            this module preloaded, else ``spawn``); ``fork`` is fastest but unsafe with threads.
        startup_timeout_s: give up (RuntimeError) if a worker has not started in this time.

    Raises:
        GoldAnswerError: some gold cannot be parsed (the first one found is named).
    """
    items = [(r[-MAX_RESPONSE_CHARS:] if isinstance(r, str) else None, g) for r, g in pairs]
    n = len(items)
    if n == 0:
        return []
    if workers != 0 and mp.current_process().daemon:
        logger.warning("grade_many in a daemonic process cannot start workers: grading in-process")
        workers = 0
    if workers == 0:
        return [grade_detailed(r, g, timeout_s=timeout_s) for r, g in items]
    try:
        return _grade_in_workers(items, workers, timeout_s, chunk_size, mp_context,
                                 startup_timeout_s)
    except _WorkerStartError as err:
        # e.g. inside a joblib/loky worker (a parallel sweep job), where children cannot be
        # started with spawn/forkserver: grade here instead (no hard kill of stuck C code)
        logger.warning("%s; grading %d responses in this process instead", err, n)
        return [grade_detailed(r, g, timeout_s=timeout_s) for r, g in items]


class _WorkerStartError(RuntimeError):
    """No grading worker process could be started."""


def _grade_in_workers(items: list[tuple[str | None, object]], workers: int | None,
                      timeout_s: float | None, chunk_size: int | None, mp_context: str | None,
                      startup_timeout_s: float) -> list[GradeResult]:
    n = len(items)
    n_workers = max(1, workers if workers is not None else (os.cpu_count() or 1))
    if chunk_size is None:
        chunk_size = max(1, min(64, -(-n // (4 * n_workers))))
    chunks: deque[list[int]] = deque(
        list(range(i, min(i + chunk_size, n))) for i in range(0, n, chunk_size)
    )
    n_workers = min(n_workers, len(chunks))
    ctx = mp.get_context(mp_context) if mp_context else _default_context()
    hard_limit = None if timeout_s is None or timeout_s <= 0 else 2 * timeout_s + 1.0
    results: list[GradeResult | None] = [None] * n
    pool: list[_Worker] = []

    def handle(worker: _Worker, msg: tuple[Any, ...]) -> None:
        worker.last_progress = time.monotonic()
        if msg[0] == "ready":
            worker.ready = True
        elif msg[0] == "ok":
            results[msg[1]] = GradeResult(*msg[2])
            worker.pending.remove(msg[1])
        else:  # "gold"
            raise GoldAnswerError(msg[2])

    def replace(i: int, why: str) -> None:
        """Worker ``i`` died or hung: the response it was on fails, the rest are re-queued."""
        worker = pool[i]
        while True:  # keep what it finished before dying
            try:
                if not worker.conn.poll():
                    break
                handle(worker, worker.conn.recv())
            except (EOFError, OSError):
                break
        if not worker.ready:
            worker.stop(kill=True)
            raise _WorkerStartError(f"a grading worker {why} before it started")
        if worker.pending:
            idx = worker.pending.popleft()
            logger.warning("grading worker %s on response %d: counted as timed out", why, idx)
            results[idx] = GradeResult(False, None, timed_out=True)
            if worker.pending:
                chunks.appendleft(list(worker.pending))
        worker.stop(kill=True)
        pool[i] = _Worker(ctx, timeout_s)

    try:
        pool = [_Worker(ctx, timeout_s) for _ in range(n_workers)]
        while chunks or any(w.pending for w in pool):
            for i, worker in enumerate(pool):
                if worker.dead or not worker.proc.is_alive():
                    replace(i, "died")
                    continue
                if worker.ready and not worker.pending and chunks:
                    chunk = chunks.popleft()
                    try:
                        worker.conn.send([(idx, *items[idx]) for idx in chunk])
                    except (OSError, ValueError):
                        chunks.appendleft(chunk)
                        worker.dead = True
                        continue
                    worker.pending.extend(chunk)
                    worker.last_progress = time.monotonic()
            for conn in wait([w.conn for w in pool if not w.dead], timeout=0.5):
                worker = next(w for w in pool if w.conn is conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    worker.dead = True
                    continue
                handle(worker, msg)
            now = time.monotonic()
            for i, worker in enumerate(pool):
                if not worker.ready and now - worker.started > startup_timeout_s:
                    raise _WorkerStartError(
                        f"a grading worker did not start in {startup_timeout_s} s")
                if hard_limit and worker.pending and now - worker.last_progress > hard_limit:
                    replace(i, f"was stuck for {hard_limit:.0f} s")
    finally:
        for worker in pool:
            worker.stop(kill=worker.dead or bool(worker.pending))
    final = [r if r is not None else GradeResult(False, None, True) for r in results]
    n_timeouts = sum(r.timed_out for r in final)
    if n_timeouts:
        logger.warning("%d of %d responses timed out while grading (graded wrong)", n_timeouts, n)
    return final


def grade_many(
    pairs: Iterable[tuple[str | None, object]],
    *,
    workers: int | None = None,
    timeout_s: float | None = 5.0,
    chunk_size: int | None = None,
    mp_context: str | None = None,
) -> list[bool]:
    """Grades ``(response, gold)`` pairs in a process pool; a list of bools in input order.

    Each worker grades in its main thread with an alarm-based per-response deadline; timed-out
    responses are graded wrong, counted and logged (use :func:`grade_many_detailed` to get the
    flags). See :func:`grade_many_detailed` for the arguments.
    """
    return [r.correct for r in grade_many_detailed(
        pairs, workers=workers, timeout_s=timeout_s, chunk_size=chunk_size,
        mp_context=mp_context)]


# --------------------------------------------------------------------------------------------
# Exact integer answers and planted phrases (the arithmetic testbed)
# --------------------------------------------------------------------------------------------


class ExactGrade(NamedTuple):
    """The outcome of :func:`grade_exact_phrases`.

    Attributes:
        correct: the last ``\\boxed{}`` holds exactly the gold integer.
        answer: the last ``\\boxed{}``'s content (None if there is none).
        phrases: phrase name -> 1.0 if the phrase occurs in the response, else 0.0.
        shortcut: whether the response took the shortcut
            (:func:`saopd.eval.habits.follows_shortcut`); None when no ``shortcut`` was given.
    """

    correct: bool
    answer: str | None
    phrases: dict[str, float]
    shortcut: bool | None = None


def grade_exact_phrases(response: str | None, gold: object,
                        phrases: Mapping[str, str] | None = None,
                        shortcut: str | None = None) -> ExactGrade:
    """Exact-integer grading of the last ``\\boxed{}`` (no math-verify, in-process), which of
    ``phrases`` (name -> text) the response contains, verbatim, and (``shortcut``: the answer
    line's opening words) whether it gave the answer before any digit.

    Used by benchmarks graded ``exact`` (rows with ``metadata.format: exact_int``; the phrases
    come from ``metadata.phrases``, the shortcut from ``metadata.shortcut``): the arithmetic
    testbed's planted habits are such phrases, its harmful prior such a shortcut.
    A non-string response is wrong and contains nothing; the gold must be an integer (as a
    string or int), else ``GoldAnswerError``.
    """
    try:
        gold_int = int(str(gold).strip())
    except ValueError:
        raise GoldAnswerError(f"exact_int gold must be an integer, got {gold!r}") from None
    text = response if isinstance(response, str) else ""
    hits = {name: float(bool(phrase) and phrase in text)
            for name, phrase in (phrases or {}).items()}
    took = None if shortcut is None else follows_shortcut(text, shortcut)
    answer = last_boxed(text)
    if answer is None:
        return ExactGrade(False, None, hits, took)
    stripped = answer.strip()
    correct = bool(re.fullmatch(r"-?\d+", stripped)) and int(stripped) == gold_int
    return ExactGrade(correct, answer, hits, took)
