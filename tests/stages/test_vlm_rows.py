"""Rows with images (saopd.stages.vlm_rows): image values to their stored bytes, ``<image>``
placeholders to message parts, column values as lists and JSON text."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
from PIL import Image

from saopd.stages.vlm_rows import as_list, image_bytes, interleave, maybe_json, with_instruction
from tests.stages.vlm_fixtures import png


def test_image_values_give_the_stored_bytes(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(png(1))
    data = png(2)
    assert image_bytes({"bytes": data, "path": "x"}) == data
    assert image_bytes({"bytes": None, "path": "a.png"}, tmp_path) == png(1)
    assert image_bytes("a.png", tmp_path) == png(1)
    assert image_bytes(base64.b64encode(data).decode()) == data
    assert image_bytes("data:image/png;base64," + base64.b64encode(data).decode()) == data
    assert image_bytes(Image.open(io.BytesIO(data)))[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="neither a readable file nor base64"):
        image_bytes("no/such/file.png", tmp_path)
    with pytest.raises(ValueError, match="neither bytes nor path"):
        image_bytes({"bytes": None, "path": None})
    with pytest.raises(ValueError, match=r"no image \(got NoneType\)"):
        image_bytes(None)


def test_placeholders_become_image_parts_in_order() -> None:
    assert interleave("A <image1> B <image2>", ["x", "y"]) == [
        {"type": "text", "text": "A"}, {"type": "image", "image": "x"},
        {"type": "text", "text": "B"}, {"type": "image", "image": "y"}]
    assert interleave("<image>What is x?", ["x"]) == [
        {"type": "image", "image": "x"}, {"type": "text", "text": "What is x?"}]
    assert interleave("No placeholder.", ["x", "y"]) == [  # images first, then the text
        {"type": "image", "image": "x"}, {"type": "image", "image": "y"},
        {"type": "text", "text": "No placeholder."}]
    with pytest.raises(ValueError, match=r"2 <image> placeholder\(s\) but the row has 1 image"):
        interleave("<image> and <image>", ["x"])


def test_column_values() -> None:
    assert as_list(None) == [] and as_list(("a", "b")) == ["a", "b"] and as_list("a") == ["a"]
    assert maybe_json('["15", "4"]') == ["15", "4"] and maybe_json('{"a": 1}') == {"a": 1}
    assert maybe_json("[not json") == "[not json" and maybe_json("15") == "15"
    assert with_instruction("  Find x. ", "Think.") == "Find x.\nThink."
    assert with_instruction("  Find x. ", None) == with_instruction("Find x.", "") == "Find x."
