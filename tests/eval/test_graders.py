"""The graders' registry (saopd.eval.graders): the one list of grader kinds, and each kind's
scores on hand-made samples (the in-process ones; math-verify's worker pool is covered by
tests/eval/test_grading.py and test_runner.py)."""

from __future__ import annotations

import pytest

from saopd.eval.graders import GRADERS
from saopd.eval.runner import EvalProblem


def _problems(**metadata: dict) -> dict[str, EvalProblem]:
    return {pid: EvalProblem(pid, [{"role": "user", "content": "q"}], "3", "toy", meta)
            for pid, meta in metadata.items()}


def test_the_registry_is_the_list_of_kinds() -> None:
    assert GRADERS.names() == ["exact", "math", "mmifeval", "vision"]
    assert all(callable(GRADERS.get(kind)) for kind in GRADERS)
    with pytest.raises(ValueError, match="unknown grader 'regex'; allowed: exact, math"):
        GRADERS.get("regex")


def test_exact_scores_answers_phrases_and_the_shortcut_per_sample() -> None:
    problems = _problems(a={"phrases": {"tic": "Wait"}, "shortcut": "So the answer is"},
                         b={})
    samples = [
        {"id": "a", "response": "1 + 2 = 3\nSo the answer is \\boxed{3}.\nWait", "gold": "3"},
        {"id": "a", "response": "So the answer is \\boxed{4}.", "gold": "3"},
        {"id": "b", "response": "\\boxed{3}", "gold": "3"},
        {"id": "b", "response": None, "gold": "3"},
    ]
    scores = GRADERS.get("exact")(samples, problems, grade_workers=None, judge=None)
    assert scores == [1.0, 0.0, 1.0, 0.0]
    assert samples[0]["metrics"] == {"phrase_tic": 1.0, "shortcut": 0.0, "acc_worked": 1.0}
    assert samples[1]["metrics"] == {"phrase_tic": 0.0, "shortcut": 1.0, "acc_shortcut": 0.0}
    assert samples[2]["metrics"] == {} and samples[2]["extracted"] == "3"
    assert samples[3]["extracted"] is None


def test_math_refuses_rows_that_carry_an_answer_format() -> None:
    problems = _problems(a={"format": "count"})
    with pytest.raises(ValueError, match=r"answer format\(s\) \['count'\].*'vision'"):
        GRADERS.get("math")([{"id": "a", "response": "3", "gold": "3"}], problems,
                            grade_workers=1, judge=None)


def test_vision_grades_formatted_rows_in_process() -> None:
    problems = _problems(a={"format": "count"}, b={"format": "choice",
                                                   "choices": ["red", "blue"]})
    samples = [{"id": "a", "response": "There are \\boxed{3} cats.", "gold": "3"},
               {"id": "a", "response": "\\boxed{4}", "gold": "3"}]
    scores = GRADERS.get("vision")(samples, problems, grade_workers=1, judge=None)
    assert scores == [1.0, 0.0]
    assert samples[0]["extracted"] == "3" and samples[1]["extracted"] == "4"
