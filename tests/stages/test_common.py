"""What the stages share (saopd.stages.common): the seeded sampler, input verification, the
report's bad-row handling, the params helpers and gold answers as strings."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest

from saopd.stages.common import (
    DEFAULT_INSTRUCTION,
    MAX_REPORTED_ERRORS,
    PrepareError,
    StageReport,
    answer_str,
    flag_param,
    instruction_param,
    load_params,
    optional_int_param,
    param_section,
    require_param,
    resolve_path,
    seeded_sample,
    shown_path,
    verify_input,
)


def test_seeded_sample_is_the_smallest_hashes_whatever_the_order() -> None:
    keyed = [(i, f"question {i}") for i in range(50)]
    kept = seeded_sample(keyed, 0.3, seed=3)
    assert len(kept) == 15 and kept == sorted(kept)
    ranks = sorted(keyed, key=lambda p: hashlib.sha256(f"3\x1f{p[1]}".encode()).hexdigest())
    assert kept == sorted(i for i, _ in ranks[:15])  # by hand: the 15 smallest sha256
    assert seeded_sample(keyed[::-1], 0.3, seed=3) == kept
    assert seeded_sample(keyed, 0.3, seed=4) != kept
    assert seeded_sample(keyed, 1.0, seed=3) == list(range(50))
    assert seeded_sample([], 0.5, seed=0) == []
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(PrepareError, match=r"fraction must be in \(0, 1\]"):
            seeded_sample(keyed, bad, seed=0)


def test_verify_input(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"a": 1}\n\n{"a": 2}\n')
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert verify_input(path, sha256=sha.upper(), rows=2) == (sha, 2)  # blank lines not rows
    with caplog.at_level(logging.WARNING):
        assert verify_input(path, sha256=None, rows=None, name="x") == (sha, 2)
    assert "x: no expected sha256 given" in caplog.text
    with pytest.raises(PrepareError, match=r"^x: row count mismatch: expected 3 rows, got 2$"):
        verify_input(path, sha256=sha, rows=3, name="x")
    with pytest.raises(PrepareError, match=rf"^x: sha256 mismatch: expected {'0' * 64}, got "):
        verify_input(path, sha256="0" * 64, rows=2, name="x")
    with pytest.raises(PrepareError, match=r"^gone: input file not found"):
        verify_input(tmp_path / "gone", sha256=None, rows=None, name="gone")


def test_report_raises_or_counts_bad_rows() -> None:
    report = StageReport(input="in.jsonl", rows_in=3)
    with pytest.raises(PrepareError, match=r"^in\.jsonl:2: bad$"):
        report.bad("in.jsonl:2: bad", skip_bad=False)
    assert report.skipped == 0
    for i in range(MAX_REPORTED_ERRORS + 5):
        report.bad(f"in.jsonl:{i}: bad", skip_bad=True)
    d = report.as_dict()
    assert d["skipped"] == MAX_REPORTED_ERRORS + 5 and len(d["errors"]) == MAX_REPORTED_ERRORS
    assert d["errors"][0] == "in.jsonl:0: bad" and d["input"] == "in.jsonl"


def test_params_helpers(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text("- a list\n")
    with pytest.raises(PrepareError, match="expected a mapping at the top level"):
        load_params(tmp_path / "p.yaml")
    with pytest.raises(PrepareError, match="params file not found"):
        load_params(tmp_path / "none.yaml")
    cfg = {"skip_bad": "false", "rows": -1, "n": 3, "out": "data/x", "instruction": 5}
    with pytest.raises(PrepareError, match=r"^params: missing or invalid section 'stage'"):
        param_section({"stage": []}, "stage", "params")
    with pytest.raises(PrepareError, match=r"^st: missing parameter 'path'"):
        require_param(cfg, "path", "st")
    with pytest.raises(PrepareError, match="'skip_bad' must be true or false, got 'false'"):
        flag_param(cfg, "skip_bad", "st")
    assert flag_param({}, "skip_bad", "st") is False
    with pytest.raises(PrepareError, match="'rows' must be an int >= 0 or null, got -1"):
        optional_int_param(cfg, "rows", "st")
    assert optional_int_param(cfg, "n", "st") == 3 and optional_int_param({}, "n", "st") is None
    with pytest.raises(PrepareError, match="'instruction' must be a string or null, got 5"):
        instruction_param(cfg, "st")
    assert instruction_param({}, "st") == DEFAULT_INSTRUCTION
    assert instruction_param({"instruction": None}, "st") is None
    assert resolve_path(tmp_path, "data/x", "st.out") == tmp_path / "data" / "x"
    assert resolve_path(tmp_path, "/abs/x", "st.out") == Path("/abs/x")
    with pytest.raises(PrepareError, match=r"st\.out: expected a path string, got ''"):
        resolve_path(tmp_path, "", "st.out")
    assert shown_path(tmp_path / "data" / "x", tmp_path) == "data/x"
    assert shown_path(Path("/elsewhere/x"), tmp_path) == "/elsewhere/x"


@pytest.mark.parametrize(("value", "expected"), [
    (" 25 ", "25"), (27, "27"), (27.0, "27"), (-1.0, "-1"), (0.5, "0.5"), ("025", "025")])
def test_answer_str(value: object, expected: str) -> None:
    assert answer_str(value) == expected


@pytest.mark.parametrize("value", [True, None, "", "  ", float("nan"), float("inf"), [1]])
def test_answer_str_refuses(value: object) -> None:
    with pytest.raises(ValueError, match="answer"):
        answer_str(value)
