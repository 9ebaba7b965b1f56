"""The paper's VLM benchmarks (saopd.stages.vlm_eval) on tiny local exports in each benchmark's
row format: conversion with the grading formats, loading and grading through saopd-eval's
runner, and bad rows named by file and row or line."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from saopd.eval.runner import grade_samples, load_benchmark
from saopd.stages import vlm_eval
from saopd.stages.common import PrepareError
from tests.stages.vlm_fixtures import BOXED, eval_sources, mmif_rows, png, read_jsonl, write_parquet


def test_benchmarks_convert_with_their_formats(tmp_path: Path) -> None:
    params = eval_sources(tmp_path)
    report = vlm_eval.prepare_vlm_eval(params, tmp_path)
    out = tmp_path / "vlm_eval"
    b = report["benchmarks"]
    assert {n: b[n]["rows_out"] for n in b} == {
        "evochart": 2, "mmifeval": 2, "countqa": 2, "mathvision": 2, "geo3k": 1,
        "mathvista": 4}
    assert b["mmifeval"]["aux_rows_dropped"] == 1 and b["countqa"]["rows_in"] == 1
    rows = {n: read_jsonl(out / f"{n}.jsonl") for n in b}
    cq = rows["countqa"]
    assert [(r["id"], r["answer"], r["metadata"]["format"]) for r in cq] == [
        ("countqa-0-0", "15", "count"), ("countqa-0-1", "4", "count")]
    assert cq[0]["messages"][0]["content"][0]["image"] == "images/countqa/countqa-0-0-0.jpg"
    assert cq[1]["messages"][0]["content"][1]["text"] == f"How many hangers?\n{BOXED}"
    mv = rows["mathvista"]
    assert (mv[0]["answer"], mv[0]["metadata"]["format"], mv[0]["metadata"]["choices"]) == (
        "B", "choice", ["ball", "box"])
    assert (mv[1]["metadata"]["format"], mv[1]["metadata"]["tolerance"]) == ("numeric", 0.0)
    assert mv[2]["metadata"]["precision"] == 1 and mv[3]["metadata"]["format"] == "text"
    mvis = rows["mathvision"]
    assert mvis[0]["answer"] == "B" and mvis[0]["metadata"]["format"] == "choice"
    assert mvis[0]["messages"][0]["content"][0]["type"] == "image"  # at <image1>
    assert "(A) circle\n(B) square" in mvis[0]["messages"][0]["content"][1]["text"]
    assert "format" not in mvis[1]["metadata"]  # free-form: the math grader
    geo = rows["geo3k"][0]
    assert geo["answer"] == "2\\sqrt{3}" and "format" not in geo["metadata"]
    assert [r["metadata"]["format"] for r in rows["evochart"]] == ["numeric", "text"]
    c, p = rows["mmifeval"]
    assert c["messages"][0]["content"][1]["text"] == (
        "Describe it. Write exactly 2 paragraphs. Be formal.")  # no instruction appended
    assert c["metadata"]["constraints"][0]["key"] == "paras" and c["answer"] == ""
    assert p["metadata"]["answer_list"] == ["STOP"]
    assert (out / p["messages"][0]["content"][0]["image"]).read_bytes() == png(3)


def test_benchmarks_load_and_grade_through_the_runner(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    vlm_eval.prepare_vlm_eval(eval_sources(tmp_path), tmp_path)
    import saopd.eval.graders as graders

    math_calls: list = []

    def fake_math(pairs, workers=None):
        math_calls.extend(pairs)
        return [resp.endswith(f"{{{gold}}}") for resp, gold in pairs]

    monkeypatch.setattr(graders, "grade_many", fake_math)
    data_dir = tmp_path / "eval"  # saopd-eval's data_dir; vlm_eval/ is its sibling
    right = {"countqa": ["\\boxed{15}", "There are four, so 4"],
             "mathvista": ["The answer is (B)", "\\boxed{7}", "\\boxed{1.54}", "\\boxed{bob}"],
             "mathvision": ["\\boxed{B}", "\\boxed{\\frac{1}{2}}"],
             "geo3k": ["\\boxed{2\\sqrt{3}}"],
             "evochart": ["\\boxed{1240}", "The answer is Japan."],
             "mmifeval": ["First.\n\nSecond.", "STOP"]}
    wrong = {"countqa": ["\\boxed{14}", "5"],
             "mathvista": ["\\boxed{A}", "\\boxed{8}", "\\boxed{1.6}", "\\boxed{Alice}"],
             "mathvision": ["\\boxed{A}", "\\boxed{2}"], "geo3k": ["\\boxed{3}"],
             "evochart": ["\\boxed{1400}", "China"], "mmifeval": ["One paragraph.", "GO"]}
    for name in right:
        problems = load_benchmark(name, data_dir)
        by_id = {p.id: p for p in problems}
        for responses, want in ((right[name], 1.0), (wrong[name], 0.0)):
            samples = [{"id": p.id, "response": r, "gold": p.answer}
                       for p, r in zip(problems, responses, strict=True)]
            scores = grade_samples(name, samples, by_id, grade_workers=1)
            if name == "mmifeval":  # rule-graded C-Level row; P-Level needs a judge
                assert scores == [want, None], (name, responses)
                assert samples[0]["ungraded_constraints"] == 1
            else:
                assert scores == [want] * len(problems), (name, responses, scores)
    assert ("\\boxed{2\\sqrt{3}}", "2\\sqrt{3}") in math_calls  # Geo3K went to math-verify


@pytest.mark.parametrize(("bench", "mutate", "match"), [
    ("countqa", lambda r: r.update(answers=["15"]), r"countqa\.parquet\[row 0\]: needs as many "
                                                     r"answers as questions"),
    ("countqa", lambda r: r.update(answers=["15", "2.5"]), r"\[row 0\]: count answer '2.5' is "
                                                           r"not an integer"),
    ("mathvista", lambda r: r.update(answer="cone"), r"mathvista\.parquet\[row 0\]: "
                                                     r"multi_choice answer 'cone' is not one"),
    ("mathvision", lambda r: r.update(answer="E"), r"\[row 0\]: answer 'E' is not an option "
                                                   r"letter for 2 options"),
])
def test_bad_benchmark_rows(tmp_path: Path, bench: str, mutate: Callable[[dict], None],
                            match: str) -> None:
    params = eval_sources(tmp_path)
    src = tmp_path / f"{bench}.parquet"
    rows = pq.read_table(src).to_pylist()
    mutate(rows[0])
    write_parquet(src, rows)
    with pytest.raises(PrepareError, match=match):
        vlm_eval.prepare_vlm_eval(params, tmp_path)
    params["prepare_vlm_eval"]["skip_bad"] = True
    report = vlm_eval.prepare_vlm_eval(params, tmp_path)
    assert report["benchmarks"][bench]["skipped"] == 1
    assert report["benchmarks"][bench]["errors"][0].startswith(str(src) + "[row 0]")


def test_bad_mmifeval_and_jsonl_lines_name_file_and_line(tmp_path: Path) -> None:
    params = eval_sources(tmp_path)
    bench = tmp_path / "mmif" / "bench.jsonl"
    rows = mmif_rows()
    cons = json.loads(rows[0]["constraints"])
    cons[0]["judge"]["verify_funcs"][0]["func"] = "check_made_up"
    rows[0]["constraints"] = cons
    bench.write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken\n")
    with pytest.raises(PrepareError, match=r"bench\.jsonl:4: invalid JSON"):
        vlm_eval.prepare_vlm_eval(params, tmp_path)
    params["prepare_vlm_eval"]["skip_bad"] = True
    rep = vlm_eval.prepare_vlm_eval(params, tmp_path)["benchmarks"]["mmifeval"]
    assert rep["skipped"] == 2 and rep["rows_out"] == 1
    assert any(e.endswith("bench.jsonl:1: mmifeval: constraint 0 ('paras'): unknown rule "
                          "function 'check_made_up'") for e in rep["errors"])
    params["prepare_vlm_eval"]["benchmarks"]["evochart"]["source"] = "hub"
    params["prepare_vlm_eval"]["benchmarks"]["evochart"]["hub"] = {"dataset": None}
    with pytest.raises(PrepareError, match=r"evochart\.hub\.dataset is not set"):
        vlm_eval.prepare_vlm_eval(params, tmp_path)
