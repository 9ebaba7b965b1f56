"""The arithmetic testbed's ground truth (saopd.testbeds.arithmetic): token sources, the
selection by source, and a 2-step smoke run of the whole plumbing (data stage, teacher and
student stages, saopd-train with eval, token records). The stages' own tests:
tests/stages/test_testbed.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from saopd.eval.habits import follows_shortcut
from saopd.stages.testbed import (
    ANSWER_PREFIX,
    make_problems,
    prepare_testbed_data,
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
from tests.stages.test_testbed import HABITS

REPO = Path(__file__).resolve().parents[2]


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
