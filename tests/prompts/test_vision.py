"""Prompt rows with images: validation errors name file:line and the part at fault; the
``prepare_vlm`` stage is deterministic (same bytes twice), atomic, and its answers match what
is drawn."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from saopd.prompts.vision import message_images, read_vision_rows, validate_messages, vision_records
from saopd.stages.__main__ import main
from saopd.stages.synth_vqa import COLOURS, SynthError, synth_rows
from tests.helpers.vlm import synth_dir


def _row(image: str = "img.png", **extra: Any) -> dict[str, Any]:
    return {"id": "r", "answer": "1", "messages": [{"role": "user", "content": [
        {"type": "image", "image": image}, {"type": "text", "text": "How many?"}]}], **extra}


def _write(tmp: Path, rows: list[Any]) -> Path:
    Image.new("RGB", (32, 32), (1, 2, 3)).save(tmp / "img.png")
    path = tmp / "rows.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_good_rows_resolve_image_paths_against_the_jsonl(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    Image.new("RGB", (32, 32)).save(tmp_path / "sub" / "b.png")
    path = _write(tmp_path, [_row(), _row("sub/b.png", id="r2")])
    records, report = vision_records(path)
    assert report.rows == 2 and report.skipped == 0
    assert [message_images(r.messages) for r in records] == [
        [str((tmp_path / "img.png").resolve())], [str((tmp_path / "sub" / "b.png").resolve())]]
    assert records[0].answer == "1" and records[0].source == "rows"


@pytest.mark.parametrize(
    ("row", "match"),
    [
        (_row("missing.png"), r"rows.jsonl:1: messages\[0\].content\[0\]: image 'missing.png' "
                              r"not found \(looked for .*missing.png\)"),
        (_row("https://x.org/a.png"), r":1: messages\[0\].content\[0\]: image .* is remote"),
        ({"id": "r", "messages": [{"role": "user", "content": [{"type": "video", "video": "v"}]}]},
         r":1: messages\[0\].content\[0\]: part type must be 'text' or 'image', got 'video'"),
        ({"id": "r", "messages": [{"role": "robot", "content": "hi"}]},
         r":1: messages\[0\]: role must be one of \['system', 'user', 'assistant'\]"),
        ({"id": "r", "messages": [{"role": "user", "content": "q"},
                                  {"role": "assistant", "content": "a"}]},
         r":1: messages: the prompt must end with a user turn, got 'assistant' last"),
        ({"id": "r", "messages": "How many?"},
         r":1: messages: 'messages' must be a non-empty list"),
        ({"id": "r", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
         r"content\[0\]: a text part needs a string 'text'"),
        ({"messages": []}, r":1: missing field\(s\) \['id'\]"),
        ("{not json", r"rows.jsonl:1: invalid JSON"),
    ],
)
def test_bad_rows_name_the_line_and_the_problem(tmp_path: Path, row: Any, match: str) -> None:
    path = _write(tmp_path, [row])
    with pytest.raises(ValueError, match=match):
        read_vision_rows(path)


def test_unreadable_image_and_images_outside_user_turns(tmp_path: Path) -> None:
    (tmp_path / "fake.png").write_text("not an image")
    with pytest.raises(ValueError, match=r"x\[0\].content\[0\]: image 'fake.png' cannot be read"):
        validate_messages(_row("fake.png")["messages"], base_dir=tmp_path, where="x")
    Image.new("RGB", (8, 8)).save(tmp_path / "ok.png")
    msgs = [{"role": "assistant", "content": [{"type": "image", "image": "ok.png"}]},
            {"role": "user", "content": "q"}]
    with pytest.raises(ValueError, match=r"x\[0\]: images are only supported in user turns"):
        validate_messages(msgs, base_dir=tmp_path, where="x")


def test_skip_bad_counts_and_keeps_the_good_rows(tmp_path: Path) -> None:
    path = _write(tmp_path, [_row(), _row("missing.png"), "[1, 2]", _row(id="r3")])
    rows, report = read_vision_rows(path, skip_bad=True)
    assert [r["id"] for r in rows] == ["r", "r3"] and [r["line"] for r in rows] == [1, 4]
    assert report.skipped == 2
    assert "rows.jsonl:2:" in report.errors[0] and "rows.jsonl:3: expected a JSON object" in \
        report.errors[1]


# ----------------------------------------------------------------------------- prepare_vlm


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _params(tmp: Path, out: str, seed: int = 0) -> Path:
    path = tmp / f"params-{out}-{seed}.yaml"
    path.write_text(f"prepare_vlm:\n  out_dir: {out}\n  seed: {seed}\n  image_size: 96\n"
                    "  splits: {train: 7, test: 4}\n")
    return path


def test_stage_is_deterministic_and_replaces_its_output_whole(tmp_path: Path) -> None:
    assert main(["prepare_vlm", "--params", str(_params(tmp_path, "a"))]) == 0
    first = _files(tmp_path / "a")
    assert len([k for k in first if k.endswith(".png")]) == 11
    assert {"train.jsonl", "test.jsonl", "report.json"} <= set(first)
    (tmp_path / "a" / "stale.txt").write_text("left over")
    assert main(["prepare_vlm", "--params", str(_params(tmp_path, "a"))]) == 0
    assert _files(tmp_path / "a") == first  # same bytes; the old folder was replaced whole
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".a.")]  # no temp left
    assert main(["prepare_vlm", "--params", str(_params(tmp_path, "b", seed=1))]) == 0
    other = _files(tmp_path / "b")
    assert other.keys() == first.keys() and other["train.jsonl"] != first["train.jsonl"]
    report = json.loads(first["report.json"])
    assert report["splits"]["train"]["tasks"] == {"count": 3, "chart": 2, "choice": 2}


def test_stage_rows_load_and_bad_params_fail_clearly(tmp_path: Path, capsys) -> None:
    records, report = vision_records(synth_dir() / "train.jsonl")
    assert report.rows == 12 and all(len(message_images(r.messages)) == 1 for r in records)
    bad = tmp_path / "bad.yaml"
    bad.write_text("prepare_vlm:\n  out_dir: x\n  splits: {valid: 3}\n")
    assert main(["prepare_vlm", "--params", str(bad)]) == 1
    assert "prepare_vlm.splits must map some of ['train', 'test']" in capsys.readouterr().err
    with pytest.raises(SynthError, match=r"tasks must be a non-empty subset"):
        synth_rows("train", 2, tasks=("draw",))


def _pixel(png: bytes, x: int, y: int) -> tuple[int, int, int]:
    import io

    return Image.open(io.BytesIO(png)).convert("RGB").getpixel((x, y))


def test_answers_match_what_is_drawn() -> None:
    for row, png in synth_rows("test", 30, seed=3, image_size=128):
        meta = row["metadata"]
        if meta["task"] in ("count", "choice"):
            for s in meta["shapes"]:  # every listed shape is drawn in its colour at its centre
                x, y, side = s["box"]
                cy = y + side * 3 // 4 if s["shape"] == "triangle" else y + side // 2
                assert _pixel(png, x + side // 2, cy) == COLOURS[s["colour"]]
        if meta["task"] == "count":
            want = sum([s["colour"], s["shape"]] == meta["target"] for s in meta["shapes"])
            assert row["answer"] == str(want) and 1 <= want <= 5
        elif meta["task"] == "choice":
            counts = {c: sum(s["colour"] == c for s in meta["shapes"]) for c in COLOURS}
            winner = max(counts, key=counts.__getitem__)
            assert sorted(counts.values())[-1] > sorted(counts.values())[-2]
            assert meta["choices"]["ABCD".index(row["answer"])] == winner
        else:
            assert row["answer"] == str(meta["bars"][meta["asked"]])
            assert meta["format"] == "numeric" and meta["tolerance"] == 0.05
