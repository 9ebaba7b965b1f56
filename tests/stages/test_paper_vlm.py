"""The paper's VLM data stages (saopd/stages/paper_vlm.py) on tiny local fixtures in each dataset's
row format: parquet with ``{"bytes", "path"}`` images (as ``datasets``/the hub write them) and
JSONL with image files; conversion, the seeded 10% sample, bad rows, and grading of the output."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from saopd.eval.runner import _grade, load_benchmark
from saopd.prompts.vision import read_vision_rows
from saopd.stages import paper_vlm
from saopd.stages.prepare import PrepareError, main, seeded_sample

BOXED = "Please reason step by step, and put your final answer within \\boxed{}."


def png(i: int, size: int = 8, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), ((37 * i) % 256, (91 * i) % 256, (53 * i) % 256)).save(
        buf, format=fmt)
    return buf.getvalue()


def img(i: int, fmt: str = "PNG") -> dict[str, Any]:
    return {"bytes": png(i, fmt=fmt), "path": f"{i}.{fmt.lower()}"}


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mmrl_rows(n: int) -> list[dict[str, Any]]:
    return [{"problem": f"<image>Problem {i}: what is x in the figure?", "answer": str(i),
             "images": [img(i)]} for i in range(n)]


def train_params(tmp: Path, stage: str, path: Path, **extra: Any) -> dict[str, Any]:
    cfg = {"source": "local", "local": {"path": str(path)}, "fraction": 0.1, "seed": 42,
           "skip_bad": False, "out_dir": str(tmp / stage), **extra}
    return {stage: cfg}


# ----------------------------------------------------------------------------------- training


def test_mmrl30k_sample_converts_rows_and_is_deterministic(tmp_path: Path) -> None:
    src = write_parquet(tmp_path / "mmrl" / "train-00000.parquet", mmrl_rows(40))
    params = train_params(tmp_path, "prepare_vlm_reasoning", src.parent, instruction=BOXED)
    report = paper_vlm.prepare_vlm_train(params, tmp_path, "prepare_vlm_reasoning")
    out = tmp_path / "prepare_vlm_reasoning"
    rows = read_jsonl(out / "train.jsonl")
    assert (report["rows_in"], report["rows_eligible"], report["rows_sampled"],
            report["rows_out"], report["skipped"]) == (40, 40, 4, 4, 0)
    assert json.loads((out / "report.json").read_text())["rows_out"] == 4
    # the sample is the seeded hash sample of (problem, answer) pairs
    keyed = [(i, f"<image>Problem {i}: what is x in the figure?\x1f{i}") for i in range(40)]
    want = seeded_sample(keyed, 0.1, 42)
    assert [r["metadata"]["index"] for r in rows] == want
    r = rows[0]
    i = want[0]
    assert r["id"] == f"mmrl30k-{i}" and r["answer"] == str(i) and r["source"] == "mmrl30k"
    content = r["messages"][0]["content"]
    assert r["messages"][0]["role"] == "user" and len(r["messages"]) == 1
    assert content[0] == {"type": "image", "image": f"images/mmrl30k-{i}-0.png"}
    assert content[1] == {"type": "text",
                          "text": f"Problem {i}: what is x in the figure?\n{BOXED}"}
    assert (out / content[0]["image"]).read_bytes() == png(i)  # bytes kept as stored
    got, rep = read_vision_rows(out / "train.jsonl")  # the training loader accepts the file
    assert rep.rows == 4 and got[0]["messages"][0]["content"][0]["image"].startswith("/")
    # same params: byte-identical output; rows in another order: the same rows are sampled
    again = paper_vlm.prepare_vlm_train(
        train_params(tmp_path / "b", "prepare_vlm_reasoning", src.parent, instruction=BOXED),
        tmp_path / "b", "prepare_vlm_reasoning")
    assert again["jsonl_sha256"] == report["jsonl_sha256"]
    assert again["images_sha256"] == report["images_sha256"]
    shuffled = write_parquet(tmp_path / "shuf.parquet", mmrl_rows(40)[::-1])
    rev = paper_vlm.prepare_vlm_train(
        train_params(tmp_path / "c", "prepare_vlm_reasoning", shuffled),
        tmp_path / "c", "prepare_vlm_reasoning")
    rev_rows = read_jsonl(tmp_path / "c" / "prepare_vlm_reasoning" / "train.jsonl")
    assert sorted(r["answer"] for r in rev_rows) == sorted(r["answer"] for r in rows)
    assert rev["rows_out"] == 4
    other = paper_vlm.prepare_vlm_train(
        train_params(tmp_path / "d", "prepare_vlm_reasoning", src, seed=7),
        tmp_path / "d", "prepare_vlm_reasoning")
    assert other["jsonl_sha256"] != report["jsonl_sha256"]


def vero_rows() -> list[dict[str, Any]]:
    cats = ["grounding_counting_search", "captioning_instruction_following", "stem",
            "chart_ocr"]
    rows = []
    for i in range(24):
        rows.append({
            "prompt": [{"role": "system", "content": "Think in <think></think> tags."},
                       {"role": "user", "content": f"<image>\nTask {i}: find the cat."}],
            "images": [img(i, "JPEG")],
            "data_source": f"src{i % 3}",
            "ability": cats[i % 4],
            "reward_model": {"ground_truth": f"[{i}, {i + 1}, 5, 9]", "style": "rule"},
        })
    return rows


def test_vero_keeps_the_three_subsets_and_the_system_turn(tmp_path: Path) -> None:
    src = write_parquet(tmp_path / "vero.parquet", vero_rows())
    params = train_params(tmp_path, "prepare_vlm_understanding", src, fraction=0.5,
                          categories=["grounding_counting_search",
                                      "captioning_instruction_following"])
    report = paper_vlm.prepare_vlm_train(params, tmp_path, "prepare_vlm_understanding")
    assert report["rows_eligible"] == 12 and report["rows_out"] == 6
    assert report["categories"] == {"grounding_counting_search": 6,
                                    "captioning_instruction_following": 6}
    rows = read_jsonl(tmp_path / "prepare_vlm_understanding" / "train.jsonl")
    assert {r["metadata"]["category"] for r in rows} <= {"grounding_counting_search",
                                                         "captioning_instruction_following"}
    r = rows[0]
    i = r["metadata"]["index"]
    assert r["messages"][0] == {"role": "system", "content": "Think in <think></think> tags."}
    assert r["messages"][1]["content"] == [
        {"type": "image", "image": f"images/vero-{i}-0.jpg"},
        {"type": "text", "text": f"Task {i}: find the cat."}]
    assert r["answer"] == f"[{i}, {i + 1}, 5, 9]" and r["metadata"]["source"] == f"src{i % 3}"
    params["prepare_vlm_understanding"]["categories"] = ["Grounding"]
    with pytest.raises(PrepareError, match=r"no row has 'ability' in \['Grounding'\]; values "
                                           r"found: \['captioning_instruction_following'"):
        paper_vlm.prepare_vlm_train(params, tmp_path, "prepare_vlm_understanding")


def test_bad_rows_are_named_or_skipped_and_counted(tmp_path: Path) -> None:
    rows = mmrl_rows(6)
    rows[2]["problem"] = "<image> and <image>: compare them"  # 2 placeholders, 1 image
    rows[4]["images"] = [{"bytes": b"not an image", "path": "x.png"}]
    rows[5]["problem"] = ""
    src = write_parquet(tmp_path / "bad.parquet", rows)
    params = train_params(tmp_path, "prepare_vlm_reasoning", src, fraction=1.0)
    with pytest.raises(PrepareError, match=r"bad\.parquet\[row 5\]: missing or empty prompt"):
        paper_vlm.prepare_vlm_train(params, tmp_path, "prepare_vlm_reasoning")
    rows[5]["problem"] = "<image>fine"
    write_parquet(src, rows)
    with pytest.raises(PrepareError, match=r"bad\.parquet\[row 2\]: the text has 2 <image> "
                                           r"placeholder\(s\) but the row has 1 image"):
        paper_vlm.prepare_vlm_train(params, tmp_path, "prepare_vlm_reasoning")
    assert not (tmp_path / "prepare_vlm_reasoning").exists()  # nothing half-written
    params["prepare_vlm_reasoning"]["skip_bad"] = True
    report = paper_vlm.prepare_vlm_train(params, tmp_path, "prepare_vlm_reasoning")
    assert (report["rows_sampled"], report["rows_out"], report["skipped"]) == (6, 4, 2)
    assert any("[row 4]: image cannot be read" in e for e in report["errors"])
    assert any("[row 2]: the text has 2" in e for e in report["errors"])
    assert not list((tmp_path / "prepare_vlm_reasoning" / "images").glob("mmrl30k-4-*"))


def test_command_line_and_sources(tmp_path: Path, monkeypatch, capsys) -> None:
    import yaml

    src = write_parquet(tmp_path / "m.parquet", mmrl_rows(20))
    params = train_params(tmp_path, "prepare_vlm_reasoning", src)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    assert main(["prepare_vlm_reasoning", "--params", str(tmp_path / "params.yaml")]) == 0
    assert len(read_jsonl(tmp_path / "prepare_vlm_reasoning" / "train.jsonl")) == 2
    params["prepare_vlm_reasoning"]["local"]["path"] = str(tmp_path / "missing")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    assert main(["prepare_vlm_reasoning", "--params", str(tmp_path / "params.yaml")]) == 1
    assert "local input not found" in capsys.readouterr().err

    # hub: through `datasets` (a stand-in here), images as stored
    class FakeDataset:
        def __init__(self, rows: list[dict[str, Any]]) -> None:
            self.rows, self.column_names, self.features = rows, list(rows[0]), {}

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, col: str) -> list[Any]:
            return [r[col] for r in self.rows]

        def select(self, idx: list[int]) -> list[dict[str, Any]]:
            return [self.rows[i] for i in idx]

    calls = []

    def fake_load(dataset, config, split, revision):
        calls.append((dataset, config, split, revision))
        return FakeDataset(mmrl_rows(20))

    monkeypatch.setattr(paper_vlm, "_hf_load", fake_load)
    hub = {"prepare_vlm_reasoning": {
        "source": "hub", "hub": {"dataset": "XenoZLH/MMRL30k", "split": "train",
                                 "revision": "abc123"},
        "fraction": 0.1, "seed": 42, "out_dir": str(tmp_path / "hub")}}
    report = paper_vlm.prepare_vlm_train(hub, tmp_path, "prepare_vlm_reasoning")
    assert calls == [("XenoZLH/MMRL30k", None, "train", "abc123")]
    assert report["source"] == "hub" and report["revision"] == "abc123"
    local = paper_vlm.prepare_vlm_train(train_params(tmp_path / "l", "prepare_vlm_reasoning",
                                                     src), tmp_path / "l",
                                        "prepare_vlm_reasoning")
    assert report["jsonl_sha256"] == local["jsonl_sha256"]  # hub and local agree
    hub["prepare_vlm_reasoning"]["hub"]["dataset"] = None
    with pytest.raises(PrepareError, match=r"hub\.dataset is not set"):
        paper_vlm.prepare_vlm_train(hub, tmp_path, "prepare_vlm_reasoning")


def test_source_none_prepares_nothing_and_says_so(tmp_path: Path) -> None:
    params = train_params(tmp_path, "prepare_vlm_understanding", tmp_path / "absent")
    params["prepare_vlm_understanding"]["source"] = "none"
    (tmp_path / "prepare_vlm_understanding").mkdir()
    (tmp_path / "prepare_vlm_understanding" / "old.jsonl").write_text("{}\n")
    report = paper_vlm.prepare_vlm_train(params, tmp_path, "prepare_vlm_understanding")
    assert report["prepared"] is False and "source: none" in report["message"]
    assert [p.name for p in (tmp_path / "prepare_vlm_understanding").iterdir()] == [
        "report.json"]
    ev = eval_sources(tmp_path)
    ev["prepare_vlm_eval"]["source"] = "none"
    assert paper_vlm.prepare_vlm_eval(ev, tmp_path)["prepared"] is False
    assert [p.name for p in (tmp_path / "vlm_eval").iterdir()] == ["report.json"]
    params["prepare_vlm_understanding"]["source"] = "web"
    with pytest.raises(PrepareError, match="source must be one of"):
        paper_vlm.prepare_vlm_train(params, tmp_path, "prepare_vlm_understanding")


def test_module_command_reports_stage_errors_without_a_traceback(tmp_path: Path) -> None:
    import subprocess
    import sys

    import yaml

    params = train_params(tmp_path, "prepare_vlm_reasoning", tmp_path / "missing.parquet")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    res = subprocess.run([sys.executable, "-m", "saopd.stages.prepare", "prepare_vlm_reasoning",
                          "--params", str(tmp_path / "params.yaml")], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 1, res.stderr
    assert "local input not found" in res.stderr and "Traceback" not in res.stderr


def test_hub_without_datasets_says_how_to_go_offline() -> None:
    pytest.importorskip("PIL")
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(PrepareError, match=r"not installed.*source: local"):
            paper_vlm._hf_load("XenoZLH/MMRL30k", None, "train", None)
    else:  # pragma: no cover - only where datasets is installed
        pytest.skip("datasets is installed")


def test_image_values_and_placeholders(tmp_path: Path) -> None:
    import base64

    (tmp_path / "a.png").write_bytes(png(1))
    data = png(2)
    assert paper_vlm.image_bytes({"bytes": data, "path": "x"}) == data
    assert paper_vlm.image_bytes({"bytes": None, "path": "a.png"}, tmp_path) == png(1)
    assert paper_vlm.image_bytes("a.png", tmp_path) == png(1)
    assert paper_vlm.image_bytes(base64.b64encode(data).decode()) == data
    assert paper_vlm.image_bytes(Image.open(io.BytesIO(data)))[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="neither a readable file nor base64"):
        paper_vlm.image_bytes("no/such/file.png", tmp_path)
    assert paper_vlm.interleave("A <image1> B <image2>", ["x", "y"]) == [
        {"type": "text", "text": "A"}, {"type": "image", "image": "x"},
        {"type": "text", "text": "B"}, {"type": "image", "image": "y"}]


# --------------------------------------------------------------------------------- benchmarks


def mmif_rows() -> list[dict[str, Any]]:
    cons = [{"key": "paras", "value": "Write exactly 2 paragraphs.", "judge": {
                "method": "rule_based", "verify_funcs": [
                    {"func": "check_whether_response_paragraph_number_in_range",
                     "params": [2, 2]}]}},
            {"key": "tone", "value": "Be formal.", "judge": {"method": "direct_gpt"}}]
    return [
        {"id": "c1", "tag": "C-Level", "infer_type": "main", "instruction": "Describe it.",
         "constraints": json.dumps(cons), "question": None, "answer": None, "image": "i/1.png"},
        {"id": "c1", "tag": "C-Level", "infer_type": "aux_cmp_gpt", "del_cons": "tone",
         "instruction": "Describe it.", "constraints": "[]", "image": "i/1.png"},
        {"id": "p1", "tag": "P-Level", "infer_type": "main", "question": "What is written?",
         "answer": "[\"STOP\"]", "image": base64_png(3)},
    ]


def base64_png(i: int) -> str:
    import base64

    return base64.b64encode(png(i)).decode()


def eval_sources(tmp: Path) -> dict[str, Any]:
    (tmp / "mmif" / "i").mkdir(parents=True)
    (tmp / "mmif" / "i" / "1.png").write_bytes(png(1))
    (tmp / "mmif" / "bench.jsonl").write_text(
        "\n".join(json.dumps(r) for r in mmif_rows()) + "\n")
    write_parquet(tmp / "countqa.parquet", [
        {"image": img(1, "JPEG"), "questions": ["How many jackets?", "How many hangers?"],
         "answers": ["15", "4"], "categories": ["Clothing"], "is_focused": False}])
    write_parquet(tmp / "mathvista.parquet", [
        {"pid": "1", "query": "Hint: pick one.\nQuestion: Which is red?\nChoices:\n(A) ball\n"
         "(B) box", "question": "Which is red?", "decoded_image": img(2), "choices": ["ball",
         "box"], "answer": "box", "question_type": "multi_choice", "answer_type": "text",
         "precision": None, "unit": None},
        {"pid": "2", "query": "How many?", "question": "How many?", "decoded_image": img(3),
         "choices": None, "answer": "7", "question_type": "free_form",
         "answer_type": "integer", "precision": None, "unit": None},
        {"pid": "3", "query": "Length?", "question": "Length?", "decoded_image": img(4),
         "choices": None, "answer": "1.5", "question_type": "free_form",
         "answer_type": "float", "precision": 1.0, "unit": None},
        {"pid": "4", "query": "Name?", "question": "Name?", "decoded_image": img(5),
         "choices": None, "answer": "Bob", "question_type": "free_form",
         "answer_type": "text", "precision": None, "unit": None}])
    write_parquet(tmp / "mathvision.parquet", [
        {"id": "1", "question": "<image1>Which shape?", "options": ["circle", "square"],
         "decoded_image": img(6), "answer": "B", "level": 2, "subject": "geometry"},
        {"id": "2", "question": "Find x.", "options": [], "decoded_image": img(7),
         "answer": "\\frac{1}{2}", "level": 1, "subject": "algebra"}])
    write_parquet(tmp / "geo3k.parquet", [
        {"images": [img(8)], "problem": "<image>Find y.", "answer": "2\\sqrt{3}"}])
    write_parquet(tmp / "evochart.parquet", [
        {"id": "e1", "image": img(9), "question": "Sales in 2020?", "answer": "1,250"},
        {"id": "e2", "image": img(10), "question": "Which country leads?", "answer": "Japan"}])
    local = {"evochart": "evochart.parquet", "mmifeval": "mmif/bench.jsonl",
             "countqa": "countqa.parquet", "mathvision": "mathvision.parquet",
             "geo3k": "geo3k.parquet", "mathvista": "mathvista.parquet"}
    return {"prepare_vlm_eval": {  # the benchmarks inherit the stage's source
        "source": "local", "skip_bad": False, "out_dir": str(tmp / "vlm_eval"),
        "benchmarks": {n: {"local": {"path": str(tmp / p)}} for n, p in local.items()}}}


def test_benchmarks_convert_with_their_formats(tmp_path: Path) -> None:
    params = eval_sources(tmp_path)
    report = paper_vlm.prepare_vlm_eval(params, tmp_path)
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


def test_benchmarks_load_and_grade_through_the_runner(tmp_path: Path, monkeypatch) -> None:
    paper_vlm.prepare_vlm_eval(eval_sources(tmp_path), tmp_path)
    import saopd.eval.math as math_grading

    math_calls: list = []

    def fake_math(pairs, workers=None):
        math_calls.extend(pairs)
        return [resp.endswith(f"{{{gold}}}") for resp, gold in pairs]

    monkeypatch.setattr(math_grading, "grade_many", fake_math)
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
            scores = _grade(samples, by_id, grade_workers=1)
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
def test_bad_benchmark_rows(tmp_path: Path, bench: str, mutate, match: str) -> None:
    params = eval_sources(tmp_path)
    src = tmp_path / f"{bench}.parquet"
    rows = pq.read_table(src).to_pylist()
    mutate(rows[0])
    write_parquet(src, rows)
    with pytest.raises(PrepareError, match=match):
        paper_vlm.prepare_vlm_eval(params, tmp_path)
    params["prepare_vlm_eval"]["skip_bad"] = True
    report = paper_vlm.prepare_vlm_eval(params, tmp_path)
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
        paper_vlm.prepare_vlm_eval(params, tmp_path)
    params["prepare_vlm_eval"]["skip_bad"] = True
    rep = paper_vlm.prepare_vlm_eval(params, tmp_path)["benchmarks"]["mmifeval"]
    assert rep["skipped"] == 2 and rep["rows_out"] == 1
    assert any(e.endswith("bench.jsonl:1: mmifeval: constraint 0 ('paras'): unknown rule "
                          "function 'check_made_up'") for e in rep["errors"])
    params["prepare_vlm_eval"]["benchmarks"]["evochart"]["source"] = "hub"
    params["prepare_vlm_eval"]["benchmarks"]["evochart"]["hub"] = {"dataset": None}
    with pytest.raises(PrepareError, match=r"evochart\.hub\.dataset is not set"):
        paper_vlm.prepare_vlm_eval(params, tmp_path)
