"""The paper's VLM training stages (saopd.stages.paper_vlm) on tiny local fixtures in each
dataset's row format (parquet with ``{"bytes", "path"}`` images, as ``datasets``/the hub write
them), and their hub and local sources (saopd.stages.readers): conversion, the seeded 10% sample,
bad rows, ``source: none``."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from saopd.prompts.vision import read_vision_rows
from saopd.stages import paper_vlm, vlm_eval
from saopd.stages.__main__ import main
from saopd.stages.common import PrepareError, seeded_sample
from tests.stages.vlm_fixtures import (
    BOXED,
    eval_sources,
    fake_datasets,
    img,
    mmrl_rows,
    png,
    read_jsonl,
    train_params,
    write_parquet,
)


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


def test_command_line_and_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture) -> None:
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
    calls = fake_datasets(monkeypatch, mmrl_rows(20))
    hub = {"prepare_vlm_reasoning": {
        "source": "hub", "hub": {"dataset": "XenoZLH/MMRL30k", "split": "train",
                                 "revision": "abc123"},
        "fraction": 0.1, "seed": 42, "out_dir": str(tmp_path / "hub")}}
    report = paper_vlm.prepare_vlm_reasoning(hub, tmp_path)
    assert calls == [("XenoZLH/MMRL30k", None, "train", "abc123")]
    assert report["source"] == "hub" and report["revision"] == "abc123"
    local = paper_vlm.prepare_vlm_reasoning(train_params(tmp_path / "l", "prepare_vlm_reasoning",
                                                         src), tmp_path / "l")
    assert report["jsonl_sha256"] == local["jsonl_sha256"]  # hub and local agree
    hub["prepare_vlm_reasoning"]["hub"]["dataset"] = None
    with pytest.raises(PrepareError, match=r"hub\.dataset is not set"):
        paper_vlm.prepare_vlm_reasoning(hub, tmp_path)


def test_hub_without_datasets_says_how_to_go_offline(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    hub = {"prepare_vlm_reasoning": {
        "source": "hub", "hub": {"dataset": "XenoZLH/MMRL30k"}, "out_dir": str(tmp_path / "o")}}
    with pytest.raises(PrepareError, match=r"not installed.*source: local"):
        paper_vlm.prepare_vlm_reasoning(hub, tmp_path)

    def unreachable(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("Couldn't reach 'XenoZLH/MMRL30k' on the Hub")

    module = types.ModuleType("datasets")
    module.load_dataset = unreachable  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", module)
    with pytest.raises(PrepareError, match=r"(?s)ConnectionError.*hub is probably unreachable"
                                           r".*source: local"):
        paper_vlm.prepare_vlm_reasoning(hub, tmp_path)
    assert not (tmp_path / "o").exists()


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
    assert vlm_eval.prepare_vlm_eval(ev, tmp_path)["prepared"] is False
    assert [p.name for p in (tmp_path / "vlm_eval").iterdir()] == ["report.json"]
    params["prepare_vlm_understanding"]["source"] = "web"
    with pytest.raises(PrepareError, match="source must be one of"):
        paper_vlm.prepare_vlm_train(params, tmp_path, "prepare_vlm_understanding")
