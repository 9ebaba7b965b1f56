"""Tiny local sources in the row formats of the paper's VLM datasets, shared by the tests of
:mod:`saopd.stages.paper_vlm`, :mod:`saopd.stages.vlm_eval` and :mod:`saopd.stages.vlm_rows`:
parquet with ``{"bytes", "path"}`` images (as ``datasets``/the hub write them), JSONL with image
files, and a stand-in ``datasets`` module for the hub source."""

from __future__ import annotations

import base64
import io
import json
import sys
import types
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

BOXED = "Please reason step by step, and put your final answer within \\boxed{}."


def png(i: int, size: int = 8, fmt: str = "PNG") -> bytes:
    """Encoded bytes of a one-colour image whose colour depends on ``i``."""
    buf = io.BytesIO()
    Image.new("RGB", (size, size), ((37 * i) % 256, (91 * i) % 256, (53 * i) % 256)).save(
        buf, format=fmt)
    return buf.getvalue()


def img(i: int, fmt: str = "PNG") -> dict[str, Any]:
    """An image value as ``datasets``/parquet store it."""
    return {"bytes": png(i, fmt=fmt), "path": f"{i}.{fmt.lower()}"}


def base64_png(i: int) -> str:
    return base64.b64encode(png(i)).decode()


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mmrl_rows(n: int) -> list[dict[str, Any]]:
    """MMRL30k rows: ``problem`` with an ``<image>`` placeholder, ``answer``, ``images``."""
    return [{"problem": f"<image>Problem {i}: what is x in the figure?", "answer": str(i),
             "images": [img(i)]} for i in range(n)]


def train_params(tmp: Path, stage: str, path: Path, **extra: Any) -> dict[str, Any]:
    """Params of a training stage reading the local export ``path``, writing to ``tmp/stage``."""
    cfg = {"source": "local", "local": {"path": str(path)}, "fraction": 0.1, "seed": 42,
           "skip_bad": False, "out_dir": str(tmp / stage), **extra}
    return {stage: cfg}


class FakeHubDataset:
    """The part of ``datasets.Dataset`` that the hub source uses (no image features)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows, self.column_names, self.features = rows, list(rows[0]), {}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, col: str) -> list[Any]:
        return [r[col] for r in self.rows]

    def select(self, idx: list[int]) -> list[dict[str, Any]]:
        return [self.rows[i] for i in idx]


def fake_datasets(monkeypatch: pytest.MonkeyPatch, rows: list[dict[str, Any]]) -> list[tuple]:
    """Install a stand-in ``datasets`` module whose ``load_dataset`` serves ``rows``; returns the
    list its calls ``(dataset, config, split, revision)`` are appended to."""
    calls: list[tuple] = []

    def load_dataset(dataset: str, config: str | None = None, split: str | None = None,
                     revision: str | None = None) -> FakeHubDataset:
        calls.append((dataset, config, split, revision))
        return FakeHubDataset(rows)

    module = types.ModuleType("datasets")
    module.load_dataset = load_dataset  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", module)
    return calls


def mmif_rows() -> list[dict[str, Any]]:
    """MMIFEval rows: a C-Level row, its aux_cmp_gpt twin (dropped) and a P-Level row."""
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


def eval_sources(tmp: Path) -> dict[str, Any]:
    """Local exports of the six benchmarks under ``tmp`` and the ``prepare_vlm_eval`` params
    reading them (the benchmarks inherit the stage's ``source: local``)."""
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
    return {"prepare_vlm_eval": {
        "source": "local", "skip_bad": False, "out_dir": str(tmp / "vlm_eval"),
        "benchmarks": {n: {"local": {"path": str(tmp / p)}} for n, p in local.items()}}}
