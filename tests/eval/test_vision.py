"""VLM answer formats (counting exact match, option letters, numbers within a tolerance) on
hand-made responses; vision benchmarks through the eval runner and saopd-eval."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from saopd.eval.runner import EvalProblem, evaluate_benchmark, load_benchmark
from saopd.eval.vision import extract_choice, extract_count, extract_number, grade_vision
from saopd.evaluate import CONF_DIR, run_eval
from saopd.models.tiny import tiny_tokenizer
from saopd.prompts.vision import message_images
from saopd.rollout.base import Rollout, RolloutBatch, SamplingParams
from tests.helpers.vlm import synth_dir

CHOICES = {"choices": ["blue", "green", "red", "yellow"]}


@pytest.mark.parametrize(
    ("response", "gold", "fmt", "meta", "correct", "extracted"),
    [
        ("I see 2 red ones and 1 blue, so there are \\boxed{3} circles.", "3", "count", {},
         True, "3"),
        ("Counting: 1, 2, 3, 4. The answer is four.", "4", "count", {}, True, "4"),
        ("There are 7 triangles.", "6", "count", {}, False, "7"),
        ("There are 2.5 circles", "3", "count", {}, False, None),
        ("The answer: 1,024", "1024", "count", {}, True, "1024"),
        ("No idea.", "3", "count", {}, False, None),
        ("Red appears 3 times. The answer is (C).", "C", "choice", CHOICES, True, "C"),
        ("b", "B", "choice", CHOICES, True, "B"),
        ("\\boxed{D}", "D", "choice", CHOICES, True, "D"),
        ("Most shapes are red.", "C", "choice", CHOICES, True, "C"),
        ("Red or blue, hard to say.", "C", "choice", CHOICES, False, None),
        ("(A) is wrong, the answer is B", "B", "choice", CHOICES, True, "B"),
        ("The bar reaches 5.2", "5", "numeric", {"tolerance": 0.05}, True, "5.2"),
        ("The bar reaches 5.3", "5", "numeric", {"tolerance": 0.05}, False, "5.3"),
        ("Roughly 105 units", "100", "numeric", {}, True, "105"),
        ("Roughly 105.5 units", "100", "numeric", {}, False, "105.5"),
        ("It is 0.01", "0", "numeric", {}, False, "0.01"),
        ("It is 0", "0", "numeric", {}, True, "0"),
        ("Bar A is 3 and bar C is 8, so the answer is 8.", "8", "numeric", {}, True, "8"),
        ("about 25%", "25%", "numeric", {}, True, "25"),
    ],
)
def test_grading_on_hand_made_responses(response: str, gold: str, fmt: str, meta: dict,
                                        correct: bool, extracted: str | None) -> None:
    res = grade_vision(response, gold, fmt, meta)
    assert (res.correct, res.extracted) == (correct, extracted)


def test_extractors_and_bad_golds() -> None:
    assert extract_count("I count three, no wait, 5") == 5
    assert extract_count("5 or maybe three") == 3
    assert extract_number("-1,250.5 dollars") == -1250.5
    assert extract_choice("The answer is a cat") is None
    assert extract_choice("I pick E", letters="ABCD") is None
    with pytest.raises(ValueError, match=r"count gold answer '2.5' is not an integer"):
        grade_vision("2", "2.5", "count")
    with pytest.raises(ValueError, match=r"choice gold answer 'red' is not a single option"):
        grade_vision("A", "red", "choice")
    with pytest.raises(ValueError, match=r"unknown answer format 'bbox'"):
        grade_vision("A", "A", "bbox")


def test_synth_vqa_loads_with_images_and_formats() -> None:
    problems = load_benchmark("synth_vqa", synth_dir().parent / "eval")
    assert len(problems) == 6
    assert [p.metadata["format"] for p in problems[:3]] == ["count", "numeric", "choice"]
    for p in problems:
        (image,) = message_images(p.messages)
        assert Path(image).is_absolute() and Path(image).is_file()
    with pytest.raises(FileNotFoundError, match=r"run `dvc repro prepare_vlm`"):
        load_benchmark("synth_vqa", Path("/nonexistent/prepared/eval"))


class ScriptedEngine:
    """Answers even problems with their gold, odd ones with a wrong answer."""

    def __init__(self, problems: list[EvalProblem]) -> None:
        self.tok, self.problems, self.offset = tiny_tokenizer(), problems, 0

    def generate(self, messages, sampling: SamplingParams) -> RolloutBatch:
        batch = RolloutBatch(messages=list(messages))
        for i in range(len(messages)):
            k = self.offset + i
            gold = self.problems[k].answer
            wrong = {"choice": "Z", "count": "99", "numeric": "99"}[
                self.problems[k].metadata["format"]]
            text = f"Thinking about 7 things. The answer is {gold if k % 2 == 0 else wrong}."
            batch.rollouts.append(Rollout(i, self.tok.encode(text), finished=True))
        self.offset += len(messages)
        return batch

    def load_weights(self, named_tensors) -> None:  # pragma: no cover - protocol
        pass


def test_runner_grades_vision_formats_without_math_verify(monkeypatch) -> None:
    import saopd.eval.graders as graders

    def no_math(*args, **kwargs):
        raise AssertionError("vision rows must not go to math-verify")

    monkeypatch.setattr(graders, "grade_many", no_math)
    problems = load_benchmark("synth_vqa", synth_dir().parent / "eval")
    res = evaluate_benchmark("synth_vqa", problems, ScriptedEngine(problems), tiny_tokenizer(),
                             SamplingParams(n=1, max_new_tokens=8), batch_size=4)
    assert res.score == pytest.approx(0.5) and res.problems == 6
    assert [s["correct"] for s in res.samples] == [True, False] * 3
    assert [s["extracted"] for s in res.samples[:2]] == [problems[0].answer, "99"]


def test_saopd_eval_runs_a_tiny_vlm_on_synth_vqa(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("eval", overrides=[
            "model=tiny_qwen3_5_vl", f"data_dir={synth_dir().parent / 'eval'}",
            f"output_dir={tmp_path / 'eval'}", "benchmarks=[synth_vqa]", "limit=3", "k=2",
            "+max_new_tokens.synth_vqa=4", "log_to_mlflow=false"])
    out = run_eval(cfg)
    res = out["benchmarks"]["synth_vqa"]
    assert res["problems"] == 3 and res["k"] == 2 and 0.0 <= res["score"] <= 1.0
    rows = [json.loads(x) for x in Path(res["samples_file"]).read_text().splitlines()]
    assert len(rows) == 6 and all(r["tokens"] <= 4 for r in rows)
