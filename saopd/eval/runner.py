"""Avg@k evaluation of a benchmark through a rollout engine.

For each problem, ``k`` responses are sampled (the paper: temperature 1.0, top-p 0.95) and graded
against the gold answer; a benchmark's score is the mean over problems of the fraction of correct
samples (Avg@k; with k = 1 it is plain accuracy). Every sample is kept (problem id, sample index,
response, extracted answer, score).

What a benchmark is comes from its record (:data:`saopd.eval.benchmarks.BENCHMARKS`):
:func:`load_benchmark` reads the file the record names, and :func:`grade_samples` grades with the
record's grader (:data:`saopd.eval.graders.GRADERS`): ``math`` sends every response to
math-verify in worker processes (:func:`saopd.eval.grading.grade_many`); ``vision`` grades rows
whose ``metadata["format"]`` is ``count``, ``choice``, ``numeric`` or ``text`` with
:func:`saopd.eval.vision.grade_vision` (in-process) and rows without a format with math-verify;
``mmifeval`` scores each sample by :func:`saopd.eval.mmifeval.grade_mmifeval`: the mean over its
graded constraints. Constraints that need an LLM judge are graded only when a ``judge`` is given,
otherwise they are counted as ungraded, and a sample with nothing graded is left out of the score
(``BenchmarkResult.ungraded``). Rows with images (paths relative to the JSONL, checked by
:func:`saopd.prompts.vision.read_vision_rows`) need an engine with the model's processor.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from saopd.eval.benchmarks import BENCHMARKS
from saopd.eval.graders import GRADERS
from saopd.eval.math import extract_answer
from saopd.prompts.text import GSM8K_DIR, gsm8k_records, load_jsonl
from saopd.prompts.vision import read_vision_rows
from saopd.rollout.base import RolloutEngine, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from saopd.eval.mmifeval import MMIFEvalJudge

__all__ = [
    "REQUIRED_FIELDS",
    "BenchmarkResult",
    "EvalProblem",
    "evaluate_benchmark",
    "grade_samples",
    "load_benchmark",
]

#: Fields every row of a benchmark's JSONL must have.
REQUIRED_FIELDS = ("id", "messages", "answer")


@dataclass
class EvalProblem:
    """One benchmark problem: chat messages to sample from and the gold answer.

    ``source``: the dataset the row came from; ``metadata``: the row's metadata (for the
    ``vision`` grader, ``metadata["format"]`` in :data:`saopd.eval.vision.VISION_FORMATS`
    selects how the answer is compared, with its ``choices`` / ``tolerance``; for ``mmifeval``,
    the row's constraints).
    """

    id: str
    messages: list[dict[str, Any]]
    answer: str
    source: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class BenchmarkResult:
    """Avg@k of one benchmark and its per-sample rows.

    ``problems``: problems with at least one graded sample (the score's denominator);
    ``ungraded``: samples left without a score (MM-IFEval rows whose constraints all need a
    judge and none was given); ``ungraded_constraints``: MM-IFEval constraints not graded;
    ``extra``: per-sample side metrics a grader set (``sample["metrics"]``, e.g. the ``exact``
    grader's ``phrase_<name>``), averaged over the samples that have them.
    """

    name: str
    k: int
    score: float
    problems: int
    samples: list[dict[str, Any]] = field(default_factory=list)
    unfinished: int = 0
    ungraded: int = 0
    ungraded_constraints: int = 0
    extra: dict[str, float] = field(default_factory=dict)


def load_benchmark(name: str, data_dir: str | Path, *, limit: int | None = None,
                   skip_bad: bool = False) -> list[EvalProblem]:
    """The first ``limit`` problems (all with None) of the registered benchmark ``name``.

    The file is the record's (:class:`saopd.eval.benchmarks.Benchmark`): ``<data_dir>/<file>``
    (``..`` taken lexically, so ``data_dir`` itself need not exist), or the vendored GSM8K test
    split. Rows with images are read with their image paths checked and made absolute.

    Raises:
        ValueError: ``name`` is not registered (the message lists the registered names), or a
            row lacks a field of :data:`REQUIRED_FIELDS` (``file: row N``).
        FileNotFoundError: the file is missing (the message names the ``dvc repro`` stage that
            writes it).
    """
    record = BENCHMARKS.get(name)
    if record.file is None:
        records, _ = gsm8k_records(GSM8K_DIR / "test.jsonl", limit=limit, skip_bad=skip_bad)
        return [EvalProblem(r.id, r.messages, r.answer or "", "gsm8k") for r in records]
    path = Path(os.path.normpath(Path(data_dir) / record.file))
    if not path.is_file():
        raise FileNotFoundError(f"benchmark {name!r}: no file {path}; run "
                                f"`dvc repro {record.stage}`")
    rows, _ = load_jsonl(path, skip_bad=skip_bad)
    if any(isinstance(m.get("content"), list) for r in rows
           for m in (r.get("messages") or []) if isinstance(m, dict)):
        return _vision_problems(path, name, limit=limit, skip_bad=skip_bad)
    problems = []
    for line, row in enumerate(rows, start=1):
        missing = [f for f in REQUIRED_FIELDS if f not in row]
        if missing:
            raise ValueError(f"{path}: row {line} lacks field(s) {missing}")
        problems.append(EvalProblem(str(row["id"]), row["messages"], str(row["answer"]),
                                    row.get("source", name), dict(row.get("metadata") or {})))
        if limit is not None and len(problems) >= limit:
            break
    return problems


def _vision_problems(path: Path, name: str, *, limit: int | None, skip_bad: bool
                     ) -> list[EvalProblem]:
    """Rows with images: messages validated, image paths made absolute (``file:line`` errors)."""
    rows, _ = read_vision_rows(path, limit=limit, skip_bad=skip_bad, required=REQUIRED_FIELDS)
    return [EvalProblem(str(r["id"]), r["messages"], str(r["answer"]), r.get("source", name),
                        dict(r.get("metadata") or {})) for r in rows]


def grade_samples(name: str, samples: list[dict[str, Any]], problems: Mapping[str, EvalProblem],
                  *, grade_workers: int | None = None, judge: MMIFEvalJudge | None = None
                  ) -> list[float | None]:
    """Scores in [0, 1] of ``samples`` of benchmark ``name``, by its record's grader.

    ``samples``: dicts with ``id`` (a key of ``problems``), ``response`` and ``gold``; the grader
    may add ``extracted`` (vision formats) or ``constraints`` / ``ungraded_constraints``
    (MM-IFEval). None: a sample with nothing graded (MM-IFEval judge-only constraints without a
    ``judge``). Raises ``ValueError`` for an unregistered ``name`` (listing the registered ones).
    """
    grader = GRADERS.get(BENCHMARKS.get(name).grader)
    return grader(samples, problems, grade_workers=grade_workers, judge=judge)


def evaluate_benchmark(
    name: str,
    problems: Sequence[EvalProblem],
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    sampling: SamplingParams,
    *,
    batch_size: int = 8,
    grade_workers: int | None = None,
    progress: Callable[[int], None] | None = None,
    judge: MMIFEvalJudge | None = None,
) -> BenchmarkResult:
    """Sample ``sampling.n`` responses per problem, grade them, return Avg@k and every sample.

    ``name``: the registered benchmark (its record's grader grades, :func:`grade_samples`);
    ``problems``: its problems (:func:`load_benchmark`); ``batch_size``: problems per
    ``engine.generate`` call (each batch seeded ``sampling.seed + start`` when seeded). Each
    sample gets ``score`` (in [0, 1]; None when ungraded) and ``correct`` (``score == 1``; None
    when ungraded). A problem's score is the mean over its graded samples; the benchmark's is
    the mean over problems with a graded sample. ``judge`` grades MM-IFEval's
    judge-only constraints (:data:`saopd.eval.mmifeval.MMIFEvalJudge`).
    """
    BENCHMARKS.get(name)  # an unknown name fails here, before any sampling
    if not problems:  # an average over no problem is not a score
        raise ValueError(f"benchmark {name!r}: no problem to evaluate (an empty file, or every "
                         "row skipped)")
    samples: list[dict[str, Any]] = []
    unfinished = 0
    for start in range(0, len(problems), batch_size):
        part = problems[start:start + batch_size]
        batch_sampling = sampling
        if sampling.seed is not None:  # distinct, reproducible draws per batch
            batch_sampling = dataclasses.replace(sampling, seed=sampling.seed + start)
        rollouts = engine.generate([p.messages for p in part], batch_sampling)
        counters: dict[int, int] = {}
        for r in rollouts.rollouts:
            problem = part[r.prompt_index]
            index = counters.get(r.prompt_index, 0)
            counters[r.prompt_index] = index + 1
            text = tokenizer.decode(r.response_ids, skip_special_tokens=True)
            unfinished += not r.finished
            samples.append({"benchmark": name, "id": problem.id, "sample": index,
                            "response": text, "gold": problem.answer,
                            "extracted": extract_answer(text), "finished": r.finished,
                            "tokens": len(r.response_ids)})
        if progress is not None:
            progress(len(part))
    scores = grade_samples(name, samples, {p.id: p for p in problems},
                           grade_workers=grade_workers, judge=judge)
    per_problem: dict[str, list[float]] = {}
    ungraded = 0
    for sample, value in zip(samples, scores, strict=True):
        sample["score"] = value
        sample["correct"] = None if value is None else value >= 1.0
        if value is None:
            ungraded += 1
            continue
        per_problem.setdefault(sample["id"], []).append(value)
    score = (sum(sum(v) / len(v) for v in per_problem.values()) / len(per_problem)
             if per_problem else 0.0)
    side: dict[str, list[float]] = {}
    for sample in samples:
        for key, value in (sample.get("metrics") or {}).items():
            side.setdefault(key, []).append(float(value))
    return BenchmarkResult(name=name, k=sampling.n, score=score, problems=len(per_problem),
                           extra={k: sum(v) / len(v) for k, v in side.items()},
                           samples=samples, unfinished=unfinished, ungraded=ungraded,
                           ungraded_constraints=sum(s.get("ungraded_constraints", 0)
                                                    for s in samples))
