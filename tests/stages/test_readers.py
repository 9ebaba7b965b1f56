"""A dataset's rows from a local export (saopd.stages.readers): JSONL and parquet tables read
lazily, dotted columns, where a row is named in messages, the ``source`` parameter and the
errors that name what is wrong. (The hub path and the stages that read these tables:
tests/stages/test_paper_vlm.py, test_vlm_eval.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from saopd.stages.common import PrepareError, StageReport
from saopd.stages.readers import SOURCES, local_table, open_table, row_value, source_param

ROWS = [{"id": 1, "meta": {"answer": "3", "kind": "count"}, "text": "a"},
        {"id": 2, "meta": json.dumps({"answer": "7"}), "text": "b"},
        {"id": 3, "text": "c"}]


def _jsonl(path: Path, rows: list[dict], bad_line: bool = False) -> Path:
    lines = [json.dumps(r) for r in rows]
    if bad_line:
        lines.insert(1, "{not json")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_jsonl_table_reads_columns_rows_and_names_its_lines(tmp_path: Path) -> None:
    table = local_table(_jsonl(tmp_path / "d.jsonl", ROWS), "d.jsonl", StageReport("d"), False)
    assert len(table) == 3 and table.columns == ["id", "meta", "text"]
    assert table.column("id") == [1, 2, 3]
    # a dotted name reads a nested field, parsing JSON text on the way; None where missing
    assert table.column("meta.answer") == ["3", "7", None]
    assert [(i, r["text"]) for i, r in table.rows([2, 0])] == [(2, "c"), (0, "a")]
    assert table.where(1) == "d.jsonl:2" and table.base_dir == tmp_path
    with pytest.raises(PrepareError, match=r"d.jsonl: no column 'answer' \(columns: \['id', "):
        table.column("answer")


def test_a_bad_jsonl_line_is_named_or_skipped_and_counted(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", ROWS, bad_line=True)
    with pytest.raises(PrepareError, match=r"d\.jsonl:2"):
        local_table(path, "d.jsonl", StageReport("d"), False)
    report = StageReport("d")
    table = local_table(path, "d.jsonl", report, True)
    assert len(table) == 3 and report.skipped == 1 and "d.jsonl:2" in report.errors[0]
    assert table.where(1) == "d.jsonl:3"  # the lines after the bad one keep their numbers


def test_parquet_files_in_a_folder_are_one_table(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    (tmp_path / "snap" / "sub").mkdir(parents=True)
    pq.write_table(pa.table({"id": [1, 2], "text": ["a", "b"]}), tmp_path / "snap" / "a.parquet")
    pq.write_table(pa.table({"id": [3], "text": ["c"]}), tmp_path / "snap" / "sub" / "b.parquet")
    table = local_table(tmp_path / "snap", "snap", StageReport("s"), False)
    assert len(table) == 3 and table.column("id") == [1, 2, 3]
    assert [r["text"] for _, r in table.rows([2, 1])] == ["c", "b"]
    assert table.where(0) == "snap/a.parquet[row 0]"
    assert table.where(2) == "snap/sub/b.parquet[row 0]"
    one = local_table(tmp_path / "snap" / "a.parquet", "a.parquet", StageReport("s"), False)
    assert one.where(1) == "a.parquet[row 1]"


def test_a_folder_with_one_jsonl_and_the_errors_for_the_rest(tmp_path: Path) -> None:
    (tmp_path / "one").mkdir()
    _jsonl(tmp_path / "one" / "rows.jsonl", ROWS)
    assert len(local_table(tmp_path / "one", "one", StageReport("o"), False)) == 3
    (tmp_path / "empty").mkdir()
    with pytest.raises(PrepareError, match=r"empty: no .parquet files \(or one .jsonl file\)"):
        local_table(tmp_path / "empty", "empty", StageReport("e"), False)
    (tmp_path / "x.csv").write_text("id\n1\n")
    with pytest.raises(PrepareError, match=r"x\.csv: local input not found or not"):
        local_table(tmp_path / "x.csv", "x.csv", StageReport("x"), False)


def test_row_value_reads_dotted_names() -> None:
    assert row_value(ROWS[0], "meta.kind") == "count"
    assert row_value(ROWS[1], "meta.answer") == "7"
    assert row_value(ROWS[2], "meta.answer") is None
    assert row_value({"a": "{broken"}, "a.b") is None
    assert row_value(ROWS[0], "text") == "a"


def test_the_source_parameter_and_open_table(tmp_path: Path) -> None:
    assert SOURCES == ("none", "hub", "local")
    assert source_param({}, "stage", default="none") == "none"
    assert source_param({"source": "local"}, "stage") == "local"
    with pytest.raises(PrepareError, match=r"stage.source must be one of \['none', 'hub', "):
        source_param({"source": "ftp"}, "stage")
    _jsonl(tmp_path / "d.jsonl", ROWS)
    table, info = open_table({"local": {"path": "d.jsonl"}}, "stage", tmp_path,
                             StageReport("d"), False, "local")
    assert len(table) == 3 and info == {"source": "local", "path": "d.jsonl"}
    with pytest.raises(PrepareError, match=r"stage.source must be 'hub' or 'local' here"):
        open_table({}, "stage", tmp_path, StageReport("d"), False, "none")
