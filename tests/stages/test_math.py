"""The math stages (saopd.stages.math): vendored benchmarks, the normalised eval files, input
checks, bad-row handling, atomic writes, the DeepMath path with a fake ``datasets`` and a real
``dvc repro`` in a temporary copy of the repository."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import saopd.io
from saopd.io import encode_json_line, write_jsonl_atomic
from saopd.latex import last_boxed
from saopd.stages.common import DEFAULT_INSTRUCTION, PrepareError, load_params
from saopd.stages.math import (
    BENCHMARKS,
    DEEPMATH_COLUMNS,
    prepare_eval,
    prepare_train,
    repair_aime25_problem,
)

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "data" / "benchmarks"
PARAMS = load_params(REPO / "params.yaml")
ROWS = {"math500": 500, "aime24": 30, "aime25": 30, "amc23": 40, "minerva_math": 272}
SCHEMA_KEYS = {"id", "messages", "prompt", "answer", "source", "metadata"}
#: The code every math stage lists as a dvc.yaml dep (besides its data and params).
STAGE_CODE = {"saopd/stages/__main__.py", "saopd/stages/common.py", "saopd/stages/math.py",
              "saopd/io.py"}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _raw(name: str) -> list[dict[str, Any]]:
    return _read(BENCH / name / "test.jsonl")


def _eval_params(out_dir: Path, **benchmarks: dict[str, Any]) -> dict[str, Any]:
    """The repository's params with ``out_dir`` moved; ``benchmarks`` replaces the list."""
    params = copy.deepcopy(PARAMS)
    params["prepare_eval"]["out_dir"] = str(out_dir)
    if benchmarks:
        params["prepare_eval"]["benchmarks"] = benchmarks
    return params


def _train_params(out: Path, **changes: Any) -> dict[str, Any]:
    params = copy.deepcopy(PARAMS)
    params["prepare_train"]["out"] = str(out)
    params["prepare_train"].update(changes)
    return params


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """``prepare_eval`` run once on the vendored files: (out_dir, report)."""
    out = tmp_path_factory.mktemp("eval")
    return out, prepare_eval(_eval_params(out), REPO)


@pytest.fixture(scope="module")
def rows(prepared: tuple[Path, dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out, _ = prepared
    return {name: _read(out / f"{name}.jsonl") for name in BENCHMARKS}


# ---------------------------------------------------------------------------- vendored files


def test_vendored_files_match_params_provenance_and_licences() -> None:
    provenance = (BENCH / "PROVENANCE.md").read_text()
    benchmarks = PARAMS["prepare_eval"]["benchmarks"]
    assert set(benchmarks) == set(ROWS) == set(BENCHMARKS)
    for name, cfg in benchmarks.items():
        path = REPO / cfg["path"]
        assert path == BENCH / name / "test.jsonl"
        assert _sha(path) == cfg["sha256"]
        assert sum(1 for line in path.read_bytes().splitlines() if line.strip()) == cfg["rows"]
        assert cfg["rows"] == ROWS[name]
        assert re.search(rf"\| {name} \|.*\| {cfg['rows']} \| \d+ \| {cfg['sha256']} \|",
                         provenance), name
        licence = (BENCH / name / "LICENSE").read_text()
        assert licence.startswith(("MIT License", "                                 Apache"))
    local = PARAMS["prepare_train"]["local"]
    assert _sha(REPO / local["path"]) == local["sha256"]


def test_dvc_yaml_matches_params() -> None:
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    ev, cfg = stages["prepare_eval"], PARAMS["prepare_eval"]
    assert {c["path"] for c in cfg["benchmarks"].values()} | STAGE_CODE | {"saopd/latex.py"} == set(
        ev["deps"])
    assert set(ev["outs"]) == {f"{cfg['out_dir']}/{n}.jsonl" for n in cfg["benchmarks"]} | {
        f"{cfg['out_dir']}/report.json"}
    assert ev["params"] == ["prepare_eval"]
    tr = stages["prepare_train"]
    assert STAGE_CODE | {"saopd/prompts/text.py"} <= set(tr["deps"])
    assert tr["params"] == ["prepare_train"]
    assert "${prepare_train.out}" in tr["outs"]
    assert PARAMS["prepare_train"]["source"] in ("deepmath", "local")


# ------------------------------------------------------------------------------ eval outputs


def test_row_counts_and_report(prepared: tuple[Path, dict[str, Any]], rows: dict) -> None:
    out, report = prepared
    assert report == json.loads((out / "report.json").read_text())
    for name, n in ROWS.items():
        entry = report["benchmarks"][name]
        assert len(rows[name]) == n
        assert (entry["rows_in"], entry["rows_out"], entry["skipped"]) == (n, n, 0)
        assert entry["input_sha256"] == PARAMS["prepare_eval"]["benchmarks"][name]["sha256"]
        assert entry["output_sha256"] == _sha(out / f"{name}.jsonl")
    assert report["instruction"] == DEFAULT_INSTRUCTION == PARAMS["prepare_eval"]["instruction"]
    assert not list(out.glob(".*.tmp"))


def test_schema_of_every_row(rows: dict[str, list[dict[str, Any]]]) -> None:
    for name, recs in rows.items():
        assert len({r["id"] for r in recs}) == len(recs)
        for i, r in enumerate(recs):
            assert set(r) == SCHEMA_KEYS
            assert r["id"] == f"{name}-{i}" and r["source"] == name
            assert isinstance(r["prompt"], str) and r["prompt"] == r["prompt"].strip() != ""
            assert r["messages"] == [
                {"role": "user", "content": r["prompt"] + "\n" + DEFAULT_INSTRUCTION}
            ]
            assert isinstance(r["answer"], str) and r["answer"] == r["answer"].strip() != ""
            assert r["metadata"]["index"] == i and r["metadata"]["line"] == i + 1
            assert "\x0c" not in r["prompt"]


def test_aime25_rows_repaired(prepared: tuple[Path, dict[str, Any]], rows: dict) -> None:
    raw, recs = _raw("aime25"), rows["aime25"]
    assert prepared[1]["benchmarks"]["aime25"]["repaired_rows"] == [18, 19, 27]
    for i, (src, rec) in enumerate(zip(raw, recs, strict=True)):
        assert "\x0c" not in rec["prompt"] and "\t" not in rec["prompt"]
        if i not in (18, 19, 27):
            assert rec["prompt"] == src["problem"] and rec["metadata"]["repairs"] == {}
    assert recs[18]["prompt"].startswith(r"The product\[\prod^{63}_{k=4} \frac{\log_k (5^{k^2")
    assert recs[18]["prompt"].count(r"\frac") == 5 and recs[18]["metadata"]["repairs"] == {
        "\\f": 5}
    assert r"The circumcircle of $\triangle DEF$ intersects" in recs[19]["prompt"]
    assert recs[19]["metadata"]["repairs"] == {"\\t": 1}
    assert r"can be expressed as $\frac{m}{n}$ for relatively prime" in recs[27]["prompt"]
    assert [int(r["answer"]) for r in recs] == [
        70, 588, 16, 117, 279, 504, 821, 77, 62, 81, 259, 510, 204, 60, 735, 468, 49, 82, 106,
        336, 293, 237, 610, 149, 907, 113, 19, 248, 104, 240]
    assert all(r["answer"] == r["metadata"]["answer_int"] for r in recs)
    assert repair_aime25_problem("a\x0crac{1}{2} \triangle") == (
        r"a\frac{1}{2} \triangle", {"\\f": 1, "\\t": 1})


def test_amc23_integer_answers(rows: dict[str, list[dict[str, Any]]]) -> None:
    raw, recs = _raw("amc23"), rows["amc23"]
    assert isinstance(raw[0]["answer"], float) and raw[0]["answer"] == 27.0
    assert [r["answer"] for r in recs[:5]] == ["27", "36", "45", "3159", "36"]
    assert recs[15]["answer"] == "-1" and recs[34]["answer"] == "1625"
    for src, rec in zip(raw, recs, strict=True):
        assert re.fullmatch(r"-?\d+", rec["answer"]) and int(rec["answer"]) == src["answer"]
        assert rec["metadata"]["answer_raw"] == src["answer"]
        assert rec["metadata"]["native_id"] == src["id"]
    assert recs[30]["prompt"] == raw[30]["problem"].strip() != raw[30]["problem"]


def test_aime24_answers_kept_and_normalised(rows: dict[str, list[dict[str, Any]]]) -> None:
    recs = rows["aime24"]
    assert recs[7]["answer"] == "025" and recs[7]["metadata"]["answer_int"] == "25"
    assert recs[0]["answer"] == "204" and recs[0]["metadata"]["native_id"] == 60
    assert all(r["metadata"]["answer_int"] == str(int(r["answer"])) for r in recs)
    assert [r["prompt"] for r in recs] == [s["problem"] for s in _raw("aime24")]


def test_minerva_gold_from_last_boxed(rows: dict[str, list[dict[str, Any]]]) -> None:
    recs = rows["minerva_math"]
    assert recs[0]["answer"] == "1.6"
    assert recs[12]["answer"] == (
        r"\frac{2 \pi c^{2} R^{2}}{\lambda^{5}\left[e^{h c /(\lambda k T)}-1\right] d^{2}}")
    assert recs[28]["answer"] == r"\left[P_{0}^{2 / 5}-\frac{2}{5} g K^{-3 / 5} z\right]^{5 / 2}"
    assert recs[35]["answer"] == r"\arcsin{1.3 \sin{\theta_w}}"
    assert all(r["metadata"]["solution"] == s["solution"]
               for r, s in zip(recs, _raw("minerva_math"), strict=True))


def test_math500_answers_given_and_equal_to_last_boxed(rows: dict) -> None:
    raw, recs = _raw("math500"), rows["math500"]
    assert [r["answer"] for r in recs] == [s["answer"] for s in raw]
    assert all(last_boxed(s["solution"]) == s["answer"] for s in raw)  # 500/500 upstream
    assert recs[0]["metadata"]["unique_id"] == "test/precalculus/807.json"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{1} then \boxed{2}.", "2"),
        (r"\boxed{\frac{a}{b^{2}}}", r"\frac{a}{b^{2}}"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed {  x + 1 }", "x + 1"),
        (r"\boxed{\left\{ a \right\}} tail }", r"\left\{ a \right\}"),
        (r"no box here", None),
        (r"\boxed{\frac{1}{2}", None),
    ],
)
def test_last_boxed(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


# ------------------------------------------------------------------------------ input checks


def test_sha256_and_row_count_mismatch_name_file_expected_and_got(tmp_path: Path) -> None:
    good = PARAMS["prepare_eval"]["benchmarks"]["aime24"]
    wrong = {**good, "sha256": "0" * 64}
    with pytest.raises(PrepareError) as e:
        prepare_eval(_eval_params(tmp_path / "out", aime24=wrong), REPO)
    assert str(e.value) == (
        f"data/benchmarks/aime24/test.jsonl: sha256 mismatch: expected {'0' * 64}, "
        f"got {good['sha256']}")
    with pytest.raises(PrepareError, match=r"aime24/test.jsonl: row count mismatch: expected "
                                           r"31 rows, got 30"):
        prepare_eval(_eval_params(tmp_path / "out", aime24={**good, "rows": 31}), REPO)
    assert not (tmp_path / "out").exists()  # nothing written


def test_parameters_are_validated(tmp_path: Path) -> None:
    params = _eval_params(tmp_path / "out")
    params["prepare_eval"]["skip_bad"] = "false"
    with pytest.raises(PrepareError, match="'skip_bad' must be true or false, got 'false'"):
        prepare_eval(params, REPO)
    params = _eval_params(tmp_path / "out", gsm8k={"path": "x.jsonl"})
    with pytest.raises(PrepareError, match=r"unknown benchmark\(s\) \['gsm8k'\]"):
        prepare_eval(params, REPO)
    missing = {"path": "data/benchmarks/nope.jsonl", "sha256": None, "rows": None}
    with pytest.raises(PrepareError, match=r"data/benchmarks/nope\.jsonl: input file not found"):
        prepare_eval(_eval_params(tmp_path / "out", aime24=missing), REPO)


def _bad_amc(tmp_path: Path) -> Path:
    lines = [json.dumps({"id": i, "problem": f"What is {i}+{i}?", "answer": 2.0 * i})
             for i in range(1, 7)]
    lines[2] = '{"id": 3, "problem": "broken'
    lines[4] = json.dumps({"id": 5, "problem": "no answer here"})
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_bad_json_and_missing_field_name_file_and_line(tmp_path: Path) -> None:
    path = _bad_amc(tmp_path)
    cfg = {"path": str(path), "sha256": None, "rows": None}
    with pytest.raises(PrepareError, match=rf"^{re.escape(str(path))}:3: invalid JSON"):
        prepare_eval(_eval_params(tmp_path / "out", amc23=cfg), REPO)
    lines = path.read_text().splitlines()
    lines[2] = json.dumps({"id": 3, "problem": "What is 3+3?", "answer": 6.0})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(PrepareError, match=rf"^{re.escape(str(path))}:5: missing field 'answer'"):
        prepare_eval(_eval_params(tmp_path / "out", amc23=cfg), REPO)
    assert not (tmp_path / "out").exists()


def test_skip_bad_counts_rows_in_report(tmp_path: Path) -> None:
    path = _bad_amc(tmp_path)
    params = _eval_params(tmp_path / "out", amc23={"path": str(path), "sha256": None,
                                                   "rows": None})
    params["prepare_eval"]["skip_bad"] = True
    report = prepare_eval(params, REPO)
    entry = report["benchmarks"]["amc23"]
    assert (entry["rows_in"], entry["rows_out"], entry["skipped"]) == (6, 4, 2)
    assert [m.split(": ")[0] for m in entry["errors"]] == [f"{path}:3", f"{path}:5"]
    recs = _read(tmp_path / "out" / "amc23.jsonl")
    assert [r["answer"] for r in recs] == ["2", "4", "8", "12"]
    assert [r["metadata"]["line"] for r in recs] == [1, 2, 4, 6]
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == report


# ------------------------------------------------------------------------------ atomic write


def test_atomic_write_failure_leaves_nothing_or_the_old_file(tmp_path: Path) -> None:
    def rows_then_crash() -> Iterator[dict[str, Any]]:
        yield {"a": 1}
        yield {"a": 2}
        raise RuntimeError("disk on fire")

    new = tmp_path / "new.jsonl"
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_jsonl_atomic(new, rows_then_crash())
    assert not new.exists()
    old = tmp_path / "old.jsonl"
    old.write_text("old content\n")
    with pytest.raises(RuntimeError):
        write_jsonl_atomic(old, rows_then_crash())
    assert old.read_text() == "old content\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.jsonl"]  # no temp files left
    assert write_jsonl_atomic(old, [{"a": 1}]) == _sha(old)
    assert old.read_text() == '{"a": 1}\n'


def test_stage_failure_mid_write_keeps_old_outputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "aime25.jsonl").write_text("old\n")
    encode = encode_json_line
    calls = {"aime25": 0}

    def failing_encode(record: dict[str, Any]) -> str:
        if record["source"] == "aime25":
            calls["aime25"] += 1
            if calls["aime25"] == 10:
                raise OSError("No space left on device")
        return encode(record)

    monkeypatch.setattr(saopd.io, "encode_json_line", failing_encode)
    with pytest.raises(OSError, match="No space left"):
        prepare_eval(_eval_params(out), REPO)
    assert (out / "aime25.jsonl").read_text() == "old\n"
    assert not (out / "report.json").exists()
    assert not list(out.glob(".*"))


# ----------------------------------------------------------------------------- prepare_train


def test_train_local_gsm8k(tmp_path: Path) -> None:
    out = tmp_path / "train" / "train.jsonl"
    report = prepare_train(_train_params(out, source="local"), REPO)
    recs = _read(out)
    assert report["source"] == "local" and report["format"] == "gsm8k"
    assert (report["rows_in"], report["rows_out"], report["skipped"]) == (7473, 7473, 0)
    assert report["output_sha256"] == _sha(out)
    assert json.loads((out.parent / "report.json").read_text()) == report
    assert recs[0]["id"] == "gsm8k-train-1" and recs[0]["answer"] == "72"
    assert recs[0]["prompt"].startswith("Natalia sold clips to 48 of her friends")
    assert "\u2028" in recs[2381]["prompt"]  # written escaped: still one record per line
    assert "\u2028" not in out.read_text(encoding="utf-8")
    for r in recs:
        assert set(r) == SCHEMA_KEYS and r["source"] == "gsm8k"
        content = f"{r['prompt']}\n{DEFAULT_INSTRUCTION}"
        assert r["messages"] == [{"role": "user", "content": content}]


def _deepmath_rows(n: int = 60) -> list[dict[str, Any]]:
    """Rows with DeepMath-103K's columns (question, final_answer, difficulty, topic,
    r1_solution_1..3); difficulties cycle so that 6 of every 10 rows are >= 6."""
    cycle = [3.0, 5.5, 6.0, 6.5, 7.0, 8.5, 9.0, 4.0, 10.0, 5.0]
    return [
        {
            "question": f"Compute the value of problem {i}.",
            "final_answer": f"\\frac{{{i}}}{{2}}" if i % 3 else str(i),
            "difficulty": cycle[i % len(cycle)],
            "topic": "Mathematics -> Algebra -> Other",
            "r1_solution_1": "long reasoning " * 50,
            "r1_solution_2": "long reasoning " * 50,
            "r1_solution_3": "long reasoning " * 50,
        }
        for i in range(n)
    ]


class FakeDataset:
    """The part of ``datasets.Dataset`` that prepare_train uses."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.column_names = list(rows[0]) if rows else []
        self.selected: list[str] | None = None

    def select_columns(self, columns: list[str]) -> FakeDataset:
        new = FakeDataset([{c: r[c] for c in columns} for r in self.rows])
        self.selected = list(columns)
        return new

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter([dict(r) for r in self.rows])


@pytest.fixture
def fake_datasets(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """Inject a fake ``datasets`` module; ``state.rows`` is what ``load_dataset`` serves."""
    state = types.SimpleNamespace(rows=_deepmath_rows(), calls=[], last=None)

    def load_dataset(name: str, split: str | None = None, revision: str | None = None):
        state.calls.append((name, split, revision))
        state.last = FakeDataset(state.rows)
        return state.last

    module = types.ModuleType("datasets")
    module.load_dataset = load_dataset  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", module)
    return state


def test_train_deepmath_filters_and_samples_deterministically(
    tmp_path: Path, fake_datasets: types.SimpleNamespace
) -> None:
    out = tmp_path / "a" / "train.jsonl"
    report = prepare_train(_train_params(out, source="deepmath"), REPO)
    assert fake_datasets.calls == [("zwhe99/DeepMath-103K", "train", None)]
    assert fake_datasets.last.selected == list(DEEPMATH_COLUMNS)  # r1_solution_* never loaded
    recs = _read(out)
    assert report["source"] == "deepmath" and report["rows_in"] == 60
    assert report["rows_eligible"] == 36 and report["rows_out"] == len(recs) == round(0.3 * 36)
    by_index = fake_datasets.rows
    for r in recs:
        i = r["metadata"]["index"]
        assert set(r) == SCHEMA_KEYS and r["source"] == "deepmath" and r["id"] == f"deepmath-{i}"
        assert r["metadata"]["difficulty"] == by_index[i]["difficulty"] >= 6
        assert r["answer"] == by_index[i]["final_answer"]
        assert r["prompt"] == by_index[i]["question"]
        assert "r1_solution_1" not in json.dumps(r)
    assert [r["metadata"]["index"] for r in recs] == sorted(r["metadata"]["index"] for r in recs)

    again = tmp_path / "b" / "train.jsonl"
    prepare_train(_train_params(again, source="deepmath"), REPO)
    assert again.read_bytes() == out.read_bytes()  # same seed -> same bytes

    fake_datasets.rows = list(reversed(fake_datasets.rows))  # row order does not matter
    rev = tmp_path / "c" / "train.jsonl"
    prepare_train(_train_params(rev, source="deepmath"), REPO)
    assert {r["prompt"] for r in _read(rev)} == {r["prompt"] for r in recs}

    fake_datasets.rows = _deepmath_rows()
    other = _train_params(tmp_path / "d" / "train.jsonl", source="deepmath")
    other["prepare_train"]["deepmath"]["seed"] = 7
    prepare_train(other, REPO)
    chosen = {r["id"] for r in _read(tmp_path / "d" / "train.jsonl")}
    assert len(chosen) == len(recs) and chosen != {r["id"] for r in recs}

    everything = _train_params(tmp_path / "e" / "train.jsonl", source="deepmath")
    everything["prepare_train"]["deepmath"].update(fraction=1.0, min_difficulty=9)
    assert prepare_train(everything, REPO)["rows_out"] == 12  # 9.0 and 10.0


def test_train_deepmath_bad_rows(tmp_path: Path, fake_datasets: types.SimpleNamespace) -> None:
    fake_datasets.rows[4]["difficulty"] = None
    fake_datasets.rows[5]["final_answer"] = ""
    params = _train_params(tmp_path / "train.jsonl", source="deepmath")
    with pytest.raises(PrepareError, match=r"zwhe99/DeepMath-103K\[train\]\[4\]: missing field "
                                           r"'difficulty'"):
        prepare_train(params, REPO)
    assert not (tmp_path / "train.jsonl").exists()
    params["prepare_train"]["skip_bad"] = True
    report = prepare_train(params, REPO)
    assert report["skipped"] == 2 and report["rows_eligible"] == 34
    assert "[5]: answer must be a non-empty string" in report["errors"][1]


def test_train_deepmath_without_datasets_or_hub_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = _train_params(tmp_path / "train.jsonl", source="deepmath")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(PrepareError, match=r"`datasets` is not installed.*source: local"):
        prepare_train(params, REPO)

    def unreachable(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("Couldn't reach 'zwhe99/DeepMath-103K' on the Hub")

    module = types.ModuleType("datasets")
    module.load_dataset = unreachable  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", module)
    with pytest.raises(PrepareError, match=r"(?s)ConnectionError.*hub is probably unreachable"
                                           r".*source: local"):
        prepare_train(params, REPO)
    assert not (tmp_path / "train.jsonl").exists()
    params["prepare_train"]["source"] = "hub"
    with pytest.raises(PrepareError, match="source must be 'deepmath' or 'local', got 'hub'"):
        prepare_train(params, REPO)


def test_train_local_deepmath_jsonl_skip_bad(tmp_path: Path) -> None:
    rows = _deepmath_rows(20)
    lines = [json.dumps(r) for r in rows]
    lines[3] = "not json"
    path = tmp_path / "deepmath.jsonl"
    path.write_text("\n".join(lines) + "\n")
    params = _train_params(tmp_path / "out.jsonl", source="local",
                           local={"path": str(path), "format": "deepmath"})
    params["prepare_train"]["deepmath"]["fraction"] = 1.0
    with pytest.raises(PrepareError, match=rf"^{re.escape(str(path))}:4: invalid JSON"):
        prepare_train(params, REPO)
    params["prepare_train"]["skip_bad"] = True
    report = prepare_train(params, REPO)
    assert (report["rows_in"], report["skipped"], report["rows_out"]) == (20, 1, 11)
    assert report["errors"][0].startswith(f"{path}:4: invalid JSON")
    assert {r["id"] for r in _read(tmp_path / "out.jsonl")} >= {"deepmath-2", "deepmath-18"}


# ----------------------------------------------------------------------------------- dvc repro


def _dvc() -> str | None:
    beside = Path(sys.executable).parent / "dvc"
    return str(beside) if beside.is_file() else shutil.which("dvc")


def test_dvc_repro_in_a_fresh_copy(tmp_path: Path, prepared: tuple[Path, dict[str, Any]]) -> None:
    dvc = _dvc()
    if dvc is None or shutil.which("git") is None:
        pytest.skip("dvc or git is not installed, so `dvc repro` cannot run")
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "HF_HUB_OFFLINE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    try:
        subprocess.run([dvc, "--version"], check=True, capture_output=True, env=env, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"dvc cannot run here: {e}")

    work = tmp_path / "repo"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for rel in ("dvc.yaml", "params.yaml", ".dvcignore", ".dvc/config", ".dvc/.gitignore"):
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, work / rel)
    for rel in ("saopd", "data/benchmarks", "data/gsm8k"):
        shutil.copytree(REPO / rel, work / rel, ignore=ignore)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(args, cwd=work, env=env, capture_output=True, text=True,
                              timeout=300)

    assert run("git", "init", "-q").returncode == 0
    # the data stages: the testbed's stages train models for minutes (tests/testbeds run them)
    stages = [name for name in yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
              if not name.startswith("testbed")]
    res = run(dvc, "repro", *stages)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Running stage 'prepare_eval'" in res.stdout
    assert "Running stage 'prepare_train'" in res.stdout
    out, _ = prepared
    for name in BENCHMARKS:  # the CLI under dvc writes what the function writes
        assert _sha(work / "data/prepared/eval" / f"{name}.jsonl") == _sha(out / f"{name}.jsonl")
    assert len(_read(work / "data/prepared/train/train.jsonl")) == 7473
    assert "/train.jsonl" in (work / "data/prepared/train/.gitignore").read_text()
    assert (work / "dvc.lock").is_file()
    again = run(dvc, "repro", *stages)
    assert again.returncode == 0 and "didn't change, skipping" in again.stdout
    status = run(dvc, "status", *stages)
    assert "up to date" in status.stdout, status.stdout + status.stderr
