"""The arithmetic testbed's DVC stages (saopd.stages.testbed): the task's worked solutions and
their classes, habits and the shortcut as rendered, corrupted digits, and the committed data and
models that dvc.lock records."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from saopd.eval.grading import grade_exact_phrases
from saopd.eval.habits import Habit, follows_shortcut
from saopd.stages.testbed import (
    ANSWER_PREFIX,
    SOLUTION_KINDS,
    Problem,
    classify_solution,
    make_problems,
    render_response,
    solution_text,
)
from tests.conftest import REPO

HABITS = [Habit("preamble", "Let us think step by step.", "start"),
          Habit("signoff", "So we check the final result.", "end")]


def test_solution_is_the_column_sum_with_carries() -> None:
    assert solution_text(Problem(347, 85)) == (
        "7 + 5 = 12\n4 + 8 + 1 = 13\n3 + 1 = 4\nSo the answer is \\boxed{432}.")
    assert solution_text(Problem(99, 1)) == (  # the last carry is read off the last column sum
        "9 + 1 = 10\n9 + 1 = 10\nSo the answer is \\boxed{100}.")


def test_solutions_are_classified_against_the_exact_column_lines() -> None:
    p = Problem(347, 85)
    exact = solution_text(p)
    assert classify_solution(exact, p) == "lines_right"
    # a planted phrase before and after changes nothing; a wrong answer line after right lines
    # is still lines_right (the answer's correctness is graded apart)
    assert classify_solution("Let us think step by step.\n" + exact.replace("432", "431")
                             + "\nSo we check the final result.", p) == "lines_right"
    assert classify_solution(exact.replace("4 + 8 + 1 = 13", "4 + 8 + 1 = 14"), p) == "wrong_line"
    assert classify_solution(exact.replace("4 + 8 + 1 = 13", "4 + 8 = 12"), p) == "wrong_line"
    assert classify_solution("7 + 5 = 12\n4 + 8 = \nSo the answer is \\boxed{46}.", p) == (
        "too_few_lines")  # a line cut short still counts as a line
    assert classify_solution("7 + 5 = 12\nSo the answer is \\boxed{432}.", p) == "too_few_lines"
    assert classify_solution(exact.replace("3 + 1 = 4\n", "3 + 1 = 4\n1 = 1\n"), p) == (
        "too_many_lines")
    assert classify_solution(solution_text(p, worked=False), p) == "shortcut"
    # digits after the first answer line are not work
    assert classify_solution("So the answer is \\boxed{432}.\n7 + 5 = 12", p) == "shortcut"
    assert set(SOLUTION_KINDS) == {"lines_right", "wrong_line", "too_few_lines",
                                   "too_many_lines", "shortcut"}


def test_habits_follow_the_rate_and_not_the_input() -> None:
    habits = HABITS
    rng = random.Random(0)
    used = [render_response(p, habits, 0.5, rng)[1]
            for p in make_problems(400, max_digits=3, seed=0)]
    rate = sum("preamble" in u for u in used) / len(used)
    assert 0.4 < rate < 0.6
    text, names = render_response(Problem(1, 2), habits, 1.0, random.Random(0))
    assert names == ["preamble", "signoff"]
    assert text.startswith("Let us think step by step.\n1 + 2 = 3")
    assert text.endswith("\\boxed{3}.\nSo we check the final result.")
    grade = grade_exact_phrases(text, "3", {h.name: h.text for h in habits})
    assert grade.correct and grade.phrases == {"preamble": 1.0, "signoff": 1.0}
    assert not grade_exact_phrases("\\boxed{3.0}", "3").correct


def test_a_corrupted_digit_is_one_wrong_digit_of_the_worked_lines() -> None:
    from saopd.models.tiny import tiny_tokenizer
    from saopd.stages.testbed import build_example_ids, corrupt_one_digit

    tok = tiny_tokenizer()
    ids, start = build_example_ids(tok, "Compute 347 + 85.", solution_text(Problem(347, 85)))
    clean = list(ids)
    at = corrupt_one_digit(ids, start, tok, random.Random(3))
    assert at is not None and [i for i in range(len(ids)) if ids[i] != clean[i]] == [at]
    assert tok.decode(ids[at:at + 1]).isdigit()
    assert "\\boxed{432}" in tok.decode(ids[start:])  # the answer line is never touched


def test_the_committed_testbed_is_what_dvc_lock_records() -> None:
    """The testbed's data and models are files in git (dvc.yaml: ``cache: false``) so that
    ``make run`` trains nothing: ``dvc.lock`` must record exactly those files, the params and
    the code that made them. Otherwise ``make testbed`` would re-train them (minutes) and the
    default run would use models the lock does not describe. After changing a dependency, run
    ``dvc repro testbed_teacher testbed_student`` (or ``dvc commit`` them when the change
    cannot alter their outputs) and commit the files and the lock."""
    import os
    import shutil
    import subprocess
    import sys

    beside = Path(sys.executable).parent / "dvc"
    dvc = str(beside) if beside.is_file() else shutil.which("dvc")
    if dvc is None:
        pytest.skip("dvc is not installed")
    res = subprocess.run([dvc, "status", "testbed_data", "testbed_teacher", "testbed_teacher_prior",
                          "testbed_student"],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DVC_NO_ANALYTICS": "1"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Data and pipelines are up to date." in res.stdout, res.stdout
    for role in ("teacher", "teacher_prior", "student"):
        assert (REPO / "data" / "models" / "testbed" / role / "model.safetensors").is_file()


def test_the_shortcut_is_the_answer_line_alone() -> None:
    """The harmful prior: the answer written without the worked lines, habits still drawn."""
    text, names = render_response(Problem(347, 85), HABITS, 1.0, random.Random(0), shortcut=True)
    assert text == ("Let us think step by step.\nSo the answer is \\boxed{432}."
                    "\nSo we check the final result.")
    assert names == ["preamble", "signoff"]
    assert solution_text(Problem(347, 85), worked=False) == "So the answer is \\boxed{432}."
    assert follows_shortcut(text, ANSWER_PREFIX)
    assert not follows_shortcut(solution_text(Problem(347, 85)), ANSWER_PREFIX)
    assert not follows_shortcut("Let us think.", ANSWER_PREFIX)  # no answer line at all
    grade = grade_exact_phrases(text, "432", {h.name: h.text for h in HABITS}, ANSWER_PREFIX)
    assert grade.correct and grade.shortcut is True
    assert grade_exact_phrases(solution_text(Problem(1, 2)), "3", None,
                               ANSWER_PREFIX).shortcut is False
    assert grade_exact_phrases(text, "432").shortcut is None  # no shortcut asked: not graded
