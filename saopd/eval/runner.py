"""Avg@k evaluation on math benchmarks through the rollout engines.

For each problem, ``k`` responses are sampled (the paper: temperature 1.0, top-p 0.95) and graded
against the gold answer (:func:`saopd.eval.math.grade_many`); a benchmark's score is the mean over
problems of the fraction of correct samples (Avg@k; with k = 1 it is plain accuracy). Every sample
is kept in a JSONL (problem id, sample index, response, extracted answer, correct).

Vision-language benchmarks: rows whose user turn holds image parts (paths relative to the JSONL,
checked by :func:`saopd.prompts.vision.read_vision_rows`) and whose ``metadata["format"]`` is
``count``, ``choice`` or ``numeric`` are graded by :func:`saopd.eval.vision.grade_vision`
(counting exact match, option letters, numbers within a relative tolerance, short text); the
engine must then have the model's processor. ``synth_vqa`` names the test split of ``dvc repro
prepare_vlm``; the paper's six VLM benchmarks (:data:`VISION_BENCHMARKS`) are written by ``dvc
repro prepare_vlm_eval``. Rows whose format is ``mmifeval`` are graded by
:func:`saopd.eval.mmifeval.grade_mmifeval`: a fractional score per sample (the mean over its
graded constraints); constraints that need an LLM judge are graded only when a ``judge`` is
given, otherwise they are counted as ungraded, and a sample with nothing graded is left out of
the score (``BenchmarkResult.ungraded``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from saopd.prompts.text import gsm8k_records, load_jsonl
from saopd.rollout.base import RolloutEngine, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from saopd.eval.mmifeval import MMIFEvalJudge

MATH_BENCHMARKS = ("math500", "aime24", "aime25", "amc23", "minerva_math")
REQUIRED_FIELDS = ("id", "messages", "answer")
#: Vision benchmarks outside ``data_dir``: name -> path relative to ``data_dir``'s parent
#: (``data/prepared``), written by ``dvc repro prepare_vlm``.
VISION_BENCHMARKS = {"synth_vqa": "vlm/test.jsonl",
                     **{name: f"vlm_eval/{name}.jsonl" for name in (
                         "evochart", "mmifeval", "countqa", "mathvision", "geo3k", "mathvista")}}


@dataclass
class EvalProblem:
    """One benchmark problem: chat messages to sample from and the gold answer.

    ``metadata``: the row's metadata; ``metadata["format"]`` in
    :data:`saopd.eval.vision.VISION_FORMATS` selects the vision grading (with its ``choices`` /
    ``tolerance``), anything else the math grading.
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
    judge and none was given); ``ungraded_constraints``: MM-IFEval constraints not graded.
    """

    name: str
    k: int
    score: float
    problems: int
    samples: list[dict[str, Any]] = field(default_factory=list)
    unfinished: int = 0
    ungraded: int = 0
    ungraded_constraints: int = 0


def load_benchmark(name: str, data_dir: str | Path, *, limit: int | None = None,
                   skip_bad: bool = False) -> list[EvalProblem]:
    """Problems of ``name``: ``gsm8k`` (the vendored test split), a prepared JSONL
    ``<data_dir>/<name>.jsonl`` (``dvc repro prepare_eval`` writes them; rows with images are
    read with their image paths checked and resolved), or a vision benchmark of
    :data:`VISION_BENCHMARKS` (``synth_vqa``: ``dvc repro prepare_vlm``)."""
    if name == "gsm8k":
        from saopd.prompts.text import GSM8K_DIR

        records, _ = gsm8k_records(GSM8K_DIR / "test.jsonl", limit=limit, skip_bad=skip_bad)
        return [EvalProblem(r.id, r.messages, r.answer or "", "gsm8k") for r in records]
    path = Path(data_dir) / f"{name}.jsonl"
    if not path.is_file() and name in VISION_BENCHMARKS:
        path = Path(data_dir).parent / VISION_BENCHMARKS[name]
        if not path.is_file():
            stage = "prepare_vlm" if name == "synth_vqa" else "prepare_vlm_eval"
            raise FileNotFoundError(f"benchmark {name!r}: no file {path}; run "
                                    f"`dvc repro {stage}`")
    if not path.is_file():
        raise FileNotFoundError(
            f"benchmark {name!r}: no prepared file {path}; run `dvc repro prepare_eval` "
            f"(known benchmarks: gsm8k, {', '.join(MATH_BENCHMARKS)}, "
            f"{', '.join(VISION_BENCHMARKS)})"
        )
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
    from saopd.prompts.vision import read_vision_rows

    rows, _ = read_vision_rows(path, limit=limit, skip_bad=skip_bad, required=REQUIRED_FIELDS)
    return [EvalProblem(str(r["id"]), r["messages"], str(r["answer"]), r.get("source", name),
                        dict(r.get("metadata") or {})) for r in rows]


def _grade(samples: list[dict[str, Any]], problems: dict[str, EvalProblem],
           grade_workers: int | None, judge: MMIFEvalJudge | None = None) -> list[float | None]:
    """Scores in [0, 1] per sample: vision formats in-process
    (:func:`saopd.eval.vision.grade_vision`, which also sets the sample's ``extracted``),
    ``mmifeval`` by :func:`saopd.eval.mmifeval.grade_mmifeval` (None when nothing could be
    graded; the sample gets ``constraints`` and ``ungraded_constraints``), the rest with
    math-verify in worker processes."""
    from saopd.eval.math import grade_many
    from saopd.eval.mmifeval import grade_mmifeval
    from saopd.eval.vision import grade_vision, is_vision_format

    scores: list[float | None] = [None] * len(samples)
    math_idx = []
    for i, s in enumerate(samples):
        problem = problems[s["id"]]
        meta = problem.metadata
        if meta.get("format") == "mmifeval":
            from saopd.prompts.vision import message_images

            res_if = grade_mmifeval(s["response"], meta, judge=judge,
                                    images=[str(p) for p in message_images(problem.messages)])
            s["extracted"] = None
            s["constraints"] = res_if.constraints
            s["ungraded_constraints"] = res_if.ungraded
            scores[i] = res_if.score
        elif is_vision_format(meta.get("format")):
            res = grade_vision(s["response"], s["gold"], meta["format"], meta)
            s["extracted"] = res.extracted
            scores[i] = float(res.correct)
        else:
            math_idx.append(i)
    if math_idx:
        graded = grade_many([(samples[i]["response"], samples[i]["gold"]) for i in math_idx],
                            workers=grade_workers)
        for i, ok in zip(math_idx, graded, strict=True):
            scores[i] = float(bool(ok))
    return scores


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

    Each sample gets ``score`` (in [0, 1]; None when ungraded) and ``correct`` (``score ==
    1``; None when ungraded). A problem's score is the mean over its graded samples; the
    benchmark's is the mean over problems with a graded sample. ``judge`` grades MM-IFEval's
    judge-only constraints (:data:`saopd.eval.mmifeval.MMIFEvalJudge`).
    """
    from saopd.eval.math import extract_answer

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
    scores = _grade(samples, {p.id: p for p in problems}, grade_workers, judge)
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
    return BenchmarkResult(name=name, k=sampling.n, score=score, problems=len(per_problem),
                           samples=samples, unfinished=unfinished, ungraded=ungraded,
                           ungraded_constraints=sum(s.get("ungraded_constraints", 0)
                                                    for s in samples))
