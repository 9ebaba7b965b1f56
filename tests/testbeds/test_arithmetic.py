"""The arithmetic testbed: task rendering, token sources, and a 2-step smoke run of the whole
plumbing (data stage, teacher and student stages, saopd-train with eval, token records)."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import yaml

from saopd.eval.grading import grade_exact_phrases
from saopd.eval.habits import Habit, follows_shortcut
from saopd.stages.testbed import (
    ANSWER_PREFIX,
    SOLUTION_KINDS,
    Problem,
    classify_solution,
    make_problems,
    prepare_testbed_data,
    render_response,
    solution_text,
    train_testbed_model,
    train_testbed_student,
    train_testbed_teacher,
    train_testbed_teacher_prior,
)
from saopd.testbeds.arithmetic import (
    load_habits,
    load_shortcut,
    read_token_records,
    selection_by_source,
    token_sources,
)

REPO = Path(__file__).resolve().parents[2]
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


def test_token_sources() -> None:
    tokens = ["Let", " us", " think", " step", " by", " step", ".", "\n", "1", " +", " 2", " =",
              " 3", "\n", "So", " the", " answer", " is", " \\", "boxed", "{", "3", "}.", "<end>"]
    src = token_sources(tokens, HABITS)
    assert src[:8] == ["habit"] * 8
    assert src[8:22] == ["grounded"] * 14  # the solution and the answer line (token "3" too)
    assert src[23] == "slot"  # where the signoff could have started
    plain = token_sources(["1", " +", " 2", "\n", "So", " the", " answer", " is", " \\",
                           "boxed", "{", "3", "}.", "\n", "So", " we", " check", " the",
                           " final", " result", "."], HABITS)
    assert plain[0] == "slot" and plain[13:] == ["habit"] * 8
    assert set(plain[1:13]) == {"grounded"}


@pytest.fixture(scope="module")
def tiny_testbed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The three stages at toy size (1-layer models, 3 training steps)."""
    tmp = tmp_path_factory.mktemp("testbed")
    params = copy.deepcopy(yaml.safe_load((REPO / "params.yaml").read_text()))
    data = params["testbed_data"]
    data.update(out_dir=str(tmp / "prepared" / "testbed"), test=8, train_prompts=16)
    for role in ("teacher", "teacher_prior", "student"):
        params[f"testbed_{role}"].update(
            data_dir=data["out_dir"], model_dir=str(tmp / "models" / role), layers=1, hidden=32,
            heads=1, kv_heads=1, problems=64, steps=3, batch_size=8, threads=1, eval_limit=4)
    prepare_testbed_data(params, tmp)
    train_testbed_teacher(params, tmp)
    train_testbed_teacher_prior(params, tmp)
    report = train_testbed_student(params, tmp)
    assert set(report["held_out"]) >= {"accuracy", "phrase_preamble", "phrase_signoff",
                                       "shortcut"}
    return tmp


def test_smoke_two_steps(tiny_testbed: Path, make_cfg) -> None:
    from saopd.train import train

    tmp = tiny_testbed
    cfg = make_cfg("experiment=testbed", "steps=2", "prompts_per_step=2",
                   f"student.name_or_path={tmp / 'models' / 'student'}",
                   f"teacher.name_or_path={tmp / 'models' / 'teacher'}",
                   f"data.path={tmp / 'prepared' / 'testbed' / 'train.jsonl'}",
                   f"eval.data_dir={tmp / 'prepared' / 'eval'}", "eval.every_n_steps=1",
                   "eval.limit=4", "rollout.max_new_tokens=8", "eval.max_new_tokens=8",
                   "trainer.view_every_n_steps=1", mlflow=False, tmp=tmp)
    summary = train(cfg)
    assert summary["steps"] == 2
    assert list(summary["eval"]) == ["-1", "0", "1"]  # before training, then every step
    k = cfg.eval.k
    for folder in ("initial", "step_000001"):
        samples = [json.loads(line) for line in (Path(summary["output_dir"]) / "eval" / folder
                                                 / "arith.jsonl").read_text().splitlines()]
        assert len(samples) == 4 * k
    for x in samples:  # the habit rates, the shortcut, and the accuracy on its side of it
        took = follows_shortcut(x["response"], ANSWER_PREFIX)
        side = "acc_shortcut" if took else "acc_worked"
        assert set(x["metrics"]) == {"phrase_preamble", "phrase_signoff", "shortcut", side}
        assert x["metrics"]["shortcut"] == float(took)
        assert x["metrics"][side] == x["score"]
    records = read_token_records(Path(summary["output_dir"]) / "token_records")
    assert [r["step"] for r in records] == [0, 1]
    habits = load_habits(tmp / "prepared" / "testbed" / "task.json")
    assert load_shortcut(tmp / "prepared" / "testbed" / "task.json") == ANSWER_PREFIX
    counts = selection_by_source((x for r in records for x in r["responses"]), habits,
                                 ANSWER_PREFIX)
    out = counts.summary()
    assert out["tokens"] == sum(len(x["tokens"]) for r in records for x in r["responses"])
    assert 0.0 <= out["filtered_share"] <= 1.0


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


def test_selection_at_ratios_reapplies_the_rule_by_source() -> None:
    """The counterfactual re-applies Eq. 16 to recorded signals. A habit onset with the largest
    |A_full| and a small gap, two grounded digits with large |A| and large gaps, the rest of the
    habit certain (A = 0, gap 0) and the other grounded tokens with no divergence but a gap of
    0.5: at the paper's p1 = 0.2 the certain tokens fill Bottom_p1 and the onset stays; at
    p1 = 0.8, p2 = 0.1 the onset (and only it) is removed. A record without A_res (vanilla
    OPD) is skipped."""
    from saopd.testbeds.arithmetic import selection_at_ratios

    habit = ["Let", " us", " think", " step", " by", " step", ".", "\n"]
    body = ["1", " +", " 2", " =", " 3", "\n", "So", " the", " answer", " is", " \\", "boxed",
            "{", "3", "}.", "<end>"]
    tokens = habit + body
    a_full = [0.0] * len(habit) + [0.0] * len(body)
    a_res = [0.0] * len(habit) + [-0.5] * len(body)
    a_full[0], a_res[0] = -2.0, -1.98          # the habit onset: input-agnostic divergence
    a_full[8], a_res[8] = 1.5, 0.1             # the first digit: grounded divergence
    a_full[21], a_res[21] = 1.2, -0.3          # the answer digit: grounded
    row = dict(tokens=tokens, a_full=a_full, a_res=a_res, filtered=[0] * len(tokens))
    no_res = {"step": 1, "responses": [dict(row, a_res=None)]}
    out = selection_at_ratios([{"step": 0, "responses": [row]}, no_res], HABITS,
                              [(0.2, 0.3), (0.8, 0.1)])
    paper, wide = out[(0.2, 0.3)], out[(0.8, 0.1)]
    assert paper.summary()["tokens"] == wide.summary()["tokens"] == len(tokens)
    assert paper.summary()["habit_onsets"] == 1
    # Bottom_4(gap) = habit tokens 1-4; Top_7(|A|) = onset, both digits, then ties by index
    assert (paper.onset_filtered, paper.filtered["habit"], paper.filtered["grounded"]) == (0, 4, 0)
    assert (wide.onset_filtered, wide.filtered["habit"], wide.filtered["grounded"]) == (1, 1, 0)


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


def test_token_sources_mark_the_shortcut_decision() -> None:
    tokens = ["Let", " us", " think", " step", " by", " step", ".", "\n", "So", " the",
              " answer", " is", " \\", "boxed", "{", "3", "}.", "<end>"]
    src = token_sources(tokens, HABITS, ANSWER_PREFIX)
    assert src[:8] == ["habit"] * 8
    assert src[8] == "shortcut"  # the decision: the answer line before any worked line
    assert src[9:17] == ["grounded"] * 8 and src[17] == "slot"
    assert token_sources(tokens, HABITS)[8] == "grounded"  # a task without a shortcut
    worked = ["1", " +", " 2", " =", " 3", "\n", "So", " the", " answer", " is", " \\", "boxed",
              "{", "3", "}."]
    assert "shortcut" not in token_sources(worked, HABITS, ANSWER_PREFIX)


def _tiny_trained(rate: float | None) -> list:
    """Parameters of a 1-layer model after 2 steps (``rate=None``: the argument not given)."""
    from saopd.models.tiny import tiny_qwen3, tiny_tokenizer

    tok = tiny_tokenizer()
    model = tiny_qwen3(tok, layers=1, hidden=32, heads=1, kv_heads=1, head_dim=32, seed=0)
    extra = {} if rate is None else {"shortcut_rate": rate}
    train_testbed_model(model, tok, make_problems(32, max_digits=2, seed=0), HABITS,
                        habit_rate=0.5, residual_share=0.2, noise_share=0.3, steps=2,
                        batch_size=4, lr=1e-3, seed=0, **extra)
    return [p.detach().clone() for p in model.parameters()]


def test_shortcut_rate_zero_trains_exactly_as_without_it() -> None:
    """The shortcut is drawn from a stream of its own and only when its rate is positive: the
    clean control trains on exactly the examples of the code before the shortcut existed."""
    import torch

    default = _tiny_trained(None)
    assert all(torch.equal(a, b) for a, b in zip(_tiny_trained(0.0), default, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(_tiny_trained(1.0), default, strict=True))
