"""The graders of benchmark samples, one registry: :data:`GRADERS`, by a benchmark's ``grader``.

A :class:`saopd.eval.benchmarks.Benchmark` names its grader; :data:`GRADERS` is the one list of
the kinds that exist (a record naming another is refused when it is made):

- ``math``: math-verify on the extracted final answer, in worker processes
  (:func:`saopd.eval.grading.grade_many`);
- ``vision``: each row by its ``metadata["format"]`` (count, choice, numeric, text:
  :func:`saopd.eval.vision.grade_vision`), rows without one by math-verify;
- ``mmifeval``: the mean of each row's constraint verdicts (:mod:`saopd.eval.mmifeval`);
- ``exact``: the last ``\\boxed{}`` equals the integer gold, and each row's
  ``metadata["phrases"]`` are counted per sample (:func:`saopd.eval.grading.grade_exact_phrases`;
  logged as ``eval/<name>/phrase_<phrase>``).

A new kind: one function with :class:`SampleGrader`'s signature and one ``GRADERS.add`` line.
Nothing here imports torch, so the benchmark records that check their grader against this
registry can be listed anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from saopd.eval.grading import grade_exact_phrases, grade_many
from saopd.eval.mmifeval import grade_mmifeval
from saopd.eval.vision import grade_vision
from saopd.registry import Registry

if TYPE_CHECKING:
    from saopd.eval.mmifeval import MMIFEvalJudge
    from saopd.eval.runner import EvalProblem

__all__ = ["GRADERS", "SampleGrader"]


class SampleGrader(Protocol):
    """One grader kind: scores in [0, 1] per sample, None for a sample left ungraded.

    ``samples``: dicts with ``id`` (a key of ``problems``), ``response`` and ``gold``; a grader
    may add fields to them (``extracted``, MM-IFEval's ``constraints``). ``grade_workers``:
    math-verify processes (None = one per core); ``judge``: MM-IFEval's LLM judge, or None.
    """

    def __call__(self, samples: list[dict[str, Any]], problems: Mapping[str, EvalProblem], *,
                 grade_workers: int | None, judge: MMIFEvalJudge | None
                 ) -> list[float | None]: ...


#: Every grader kind, by name (:meth:`saopd.registry.Registry.get` returns the function).
GRADERS: Registry[SampleGrader] = Registry("grader")


def _math_scores(samples: list[dict[str, Any]], problems: Mapping[str, EvalProblem], *,
                 grade_workers: int | None, judge: MMIFEvalJudge | None) -> list[float | None]:
    """math-verify on every sample, in worker processes (0.0 or 1.0).

    A row with a ``metadata["format"]`` belongs to a ``vision``/``mmifeval`` benchmark: refused
    (``ValueError``) rather than graded as math."""
    formatted = sorted({str(problems[s["id"]].metadata["format"]) for s in samples
                        if problems[s["id"]].metadata.get("format") is not None})
    if formatted:
        raise ValueError(f"rows with answer format(s) {formatted} in a benchmark graded by "
                         "math-verify: give the benchmark the 'vision' or 'mmifeval' grader")
    graded = grade_many([(s["response"], s["gold"]) for s in samples], workers=grade_workers)
    return [float(bool(ok)) for ok in graded]


def _vision_scores(samples: list[dict[str, Any]], problems: Mapping[str, EvalProblem], *,
                   grade_workers: int | None, judge: MMIFEvalJudge | None
                   ) -> list[float | None]:
    """Rows with a format by :func:`saopd.eval.vision.grade_vision` (in-process; sets the
    sample's ``extracted``), rows without one by :func:`_math_scores`."""
    scores: list[float | None] = [None] * len(samples)
    math_idx = []
    for i, s in enumerate(samples):
        meta = problems[s["id"]].metadata
        if meta.get("format") is None:
            math_idx.append(i)
            continue
        res = grade_vision(s["response"], s["gold"], meta["format"], meta)
        s["extracted"] = res.extracted
        scores[i] = float(res.correct)
    if math_idx:
        graded = _math_scores([samples[i] for i in math_idx], problems,
                              grade_workers=grade_workers, judge=judge)
        for i, value in zip(math_idx, graded, strict=True):
            scores[i] = value
    return scores


def _mmifeval_scores(samples: list[dict[str, Any]], problems: Mapping[str, EvalProblem], *,
                     grade_workers: int | None, judge: MMIFEvalJudge | None
                     ) -> list[float | None]:
    """:func:`saopd.eval.mmifeval.grade_mmifeval` per sample (None when nothing could be graded;
    the sample gets ``constraints`` and ``ungraded_constraints``)."""
    from saopd.prompts.vision import message_images  # imports torch: only when grading

    scores: list[float | None] = []
    for s in samples:
        problem = problems[s["id"]]
        res = grade_mmifeval(s["response"], problem.metadata, judge=judge,
                             images=[str(p) for p in message_images(problem.messages)])
        s["extracted"] = None
        s["constraints"] = res.constraints
        s["ungraded_constraints"] = res.ungraded
        scores.append(res.score)
    return scores


def _exact_scores(samples: list[dict[str, Any]], problems: Mapping[str, EvalProblem], *,
                  grade_workers: int | None, judge: MMIFEvalJudge | None
                  ) -> list[float | None]:
    """:func:`saopd.eval.grading.grade_exact_phrases` per sample (in-process): exact integer
    answers; sets ``extracted`` and ``metrics`` (``phrase_<name>``: 1.0 if the row's
    ``metadata["phrases"][name]`` occurs in the response; where the row has
    ``metadata["shortcut"]``: ``shortcut``, 1.0 if the response took it, and the sample's score
    as ``acc_shortcut`` or ``acc_worked``, so that each averages over its own samples: the
    accuracy of the responses that took the shortcut and of those that did not)."""
    scores: list[float | None] = []
    for s in samples:
        meta = problems[s["id"]].metadata
        res = grade_exact_phrases(s["response"], s["gold"], meta.get("phrases"),
                                  meta.get("shortcut"))
        s["extracted"] = res.answer
        s["metrics"] = {f"phrase_{name}": hit for name, hit in res.phrases.items()}
        if res.shortcut is not None:
            s["metrics"]["shortcut"] = float(res.shortcut)
            s["metrics"]["acc_shortcut" if res.shortcut else "acc_worked"] = float(res.correct)
        scores.append(float(res.correct))
    return scores


GRADERS.add("math", _math_scores)
GRADERS.add("vision", _vision_scores)
GRADERS.add("mmifeval", _mmifeval_scores)
GRADERS.add("exact", _exact_scores)
