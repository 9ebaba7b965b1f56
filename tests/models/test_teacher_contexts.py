"""``teacher_contexts: auto | student | own``: which contexts the teacher scores, on a pair whose
two Qwen-style templates differ only in the hybrid's ``enable_thinking`` block (the shape of
Qwen3-1.7B's template against Qwen3-4B-Instruct-2507's, as far as it is known offline), and the
run record saying what happened."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest

from saopd.config import StepConfig
from saopd.contexts import context_builder
from saopd.models.factory import scored_contexts
from saopd.models.tiny import tiny_qwen3, tiny_tokenizer
from saopd.models.tokenizers import CHATML_CHAT_TEMPLATE, QWEN3_CHAT_TEMPLATE
from saopd.models.vocab import check_vocabularies
from saopd.prompts.render import render_prompt_ids
from tests.helpers.tokenizer_pairs import deepseek_style_tokenizer

THINKING_BLOCK = ("{%- if enable_thinking is defined and enable_thinking is false %}"
                  "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")
NON_THINKING = {"enable_thinking": False}
MESSAGES = [[{"role": "user", "content": "What is 2 + 3?"}]]


def hybrid_and_instruct():
    """(student, teacher): the hybrid template with its ``enable_thinking`` block, and the same
    template without it (a non-thinking-only Instruct model's shape)."""
    student, teacher = tiny_tokenizer(), tiny_tokenizer()
    student.chat_template, teacher.chat_template = QWEN3_CHAT_TEMPLATE, CHATML_CHAT_TEMPLATE
    return student, teacher


def test_the_two_templates_differ_only_in_the_thinking_block() -> None:
    assert THINKING_BLOCK in QWEN3_CHAT_TEMPLATE
    assert QWEN3_CHAT_TEMPLATE.replace(THINKING_BLOCK, "") == CHATML_CHAT_TEMPLATE
    student, teacher = hybrid_and_instruct()
    think = render_prompt_ids(student, MESSAGES[0], chat_template_kwargs=NON_THINKING)
    plain = render_prompt_ids(teacher, MESSAGES[0], chat_template_kwargs=NON_THINKING)
    assert think[:len(plain)] == plain and len(think) > len(plain)  # + the empty think block
    assert render_prompt_ids(student, MESSAGES[0]) == plain  # thinking on: the same text


def test_auto_grades_template_differs_and_the_teacher_scores_its_own_rendering() -> None:
    student, teacher = hybrid_and_instruct()
    report = check_vocabularies(student, teacher)
    assert report.kind == "template_differs"
    assert report.scored_contexts("auto") == "own" == report.scored_contexts("own")
    assert report.scored_contexts("student") == "student"
    assert "teacher_contexts=auto" in report.describe()
    assert "its own chat template" in report.describe("auto")
    assert "the student's contexts" in report.describe("student")

    response = [*student.encode("5", add_special_tokens=False), student.eos_token_id]
    step = StepConfig()
    own = context_builder(student, chat_template_kwargs=NON_THINKING, teacher_tokenizer=teacher
                          ).collate(MESSAGES, [response], step=step)
    mine = context_builder(student, chat_template_kwargs=NON_THINKING
                           ).collate(MESSAGES, [response], step=step)

    def row(ctx) -> list[int]:
        return ctx.input_ids[0][ctx.attention_mask[0].bool()].tolist()

    think = render_prompt_ids(student, MESSAGES[0], chat_template_kwargs=NON_THINKING)
    plain = render_prompt_ids(teacher, MESSAGES[0], chat_template_kwargs=NON_THINKING)
    # auto / own: the student's contexts hold the empty think block, the teacher's do not
    assert row(own.full) == think + response
    assert own.teacher is not None and row(own.teacher_view.full) == plain + response
    # student: the teacher scores exactly the student's ids (verl-literal)
    assert mine.teacher is None and row(mine.teacher_view.full) == think + response
    assert row(mine.teacher_view.residual) == row(mine.residual)


def test_same_pair_and_refusals() -> None:
    tok = tiny_tokenizer()
    same = check_vocabularies(tok, tiny_tokenizer())
    assert same.kind == "same"
    assert same.scored_contexts("auto") == "student" and same.scored_contexts("own") == "own"
    with pytest.raises(ValueError, match=r"teacher_contexts must be one of"):
        same.scored_contexts("theirs")
    # a vision-language pair cannot have teacher-own contexts, whatever the kind
    with pytest.raises(ValueError, match=r"vision-language pair is same and teacher_contexts=own"
                                         r".*use teacher_contexts=auto or student"):
        scored_contexts(same, "own", vision=True)
    assert scored_contexts(same, "auto", vision=True) == "student"
    student, teacher = hybrid_and_instruct()
    differs = check_vocabularies(student, teacher)
    with pytest.raises(ValueError, match=r"template_differs and teacher_contexts=auto"
                                         r".*teacher_contexts=student has the teacher score"):
        scored_contexts(differs, "auto", vision=True)
    assert scored_contexts(differs, "student", vision=True) == "student"


def test_student_contexts_are_refused_when_the_tokenizers_differ(qwen_tok) -> None:
    report = check_vocabularies(qwen_tok, deepseek_style_tokenizer())
    assert report.kind == "specials_differ" and report.scored_contexts() == "own"
    with pytest.raises(ValueError, match=r"teacher_contexts=student .* tokenizers differ "
                                         r"\(specials_differ: 6 special token\(s\) renamed, e\.g\. "
                                         r"id 151643 is '<\|endoftext\|>' to the student"):
        report.scored_contexts("student")


def test_the_config_checks_the_choice(make_cfg) -> None:
    from saopd.config import to_train_config

    assert to_train_config(make_cfg("experiment=tiny", mlflow=False)).teacher_contexts == "auto"
    conf = to_train_config(make_cfg("experiment=tiny", "teacher_contexts=student", mlflow=False))
    assert conf.teacher_contexts == "student"
    with pytest.raises(ValueError, match=r"teacher_contexts must be one of \['auto', 'student', "
                                         r"'own'\], got 'teacher'"):
        to_train_config(make_cfg("experiment=tiny", "teacher_contexts=teacher", mlflow=False))


@pytest.mark.parametrize(("choice", "scored"), [("auto", "own"), ("student", "student")])
def test_the_run_records_the_pair_kind_and_what_the_teacher_scored(
        make_cfg, tmp_path: Path, monkeypatch, choice: str, scored: str) -> None:
    import saopd.lightning.module as module_mod
    import saopd.scoring.passes as scoring
    from saopd.train import train

    for (name, tok), seed in zip(zip(("student", "teacher"), hybrid_and_instruct(),
                                     strict=True), (1, 2), strict=True):
        tiny_qwen3(tok, layers=1, seed=seed).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    seen: list = []
    original = scoring.score_frozen

    def spy(batch, **kw):
        seen.append(batch)
        return original(batch, **kw)

    monkeypatch.setattr(module_mod, "score_frozen", spy)
    summary = train(make_cfg(
        "experiment=tiny", "steps=1", "student.tiny=null", "teacher.tiny=null",
        f"student.name_or_path={tmp_path / 'student'}",
        f"teacher.name_or_path={tmp_path / 'teacher'}",
        "+data.chat_template_kwargs.enable_thinking=false", f"teacher_contexts={choice}"))
    record = {"choice": choice, "pair_kind": "template_differs", "scored": scored}
    assert summary["teacher_contexts"] == record
    written = json.loads((Path(summary["output_dir"]) / "summary.json").read_text())
    assert written["teacher_contexts"] == record
    params = mlflow.MlflowClient(summary["tracking_uri"]).get_run(summary["run_id"]).data.params
    assert params["teacher_contexts"] == choice
    assert params["teacher_contexts.pair_kind"] == "template_differs"
    assert params["teacher_contexts.scored"] == scored
    assert seen and (seen[0].teacher is not None) == (scored == "own")
