"""Stage ``prepare_vlm``: a small real-image VQA dataset rendered offline, with exact answers.

For tests and the CPU experiment (``experiment=tiny_vlm``) of vision-language OPD: no dataset hub
is reachable here, so the images are drawn with PIL from a seed. Three task kinds, cycled by row
index (row ``i`` is ``TASKS[i % len(tasks)]``), mirror the answer formats of the paper's
visual-understanding benchmarks (CountQA: counting exact match; EvoChart: chart values; multiple
choice as in MathVista):

- ``count`` (``format: count``): a scene of coloured shapes (circle, square, triangle in red,
  green, blue, yellow) on a 4x4 grid of cells, one shape per cell; "How many <colour> <shape>s
  are there?"; the answer is the exact count (1-5) as an integer string;
- ``chart`` (``format: numeric``): a bar chart of 3-5 bars labelled A-E with integer values
  1-9 on a 0-10 axis with gridlines; "What is the value of bar C?"; the answer is the integer,
  graded with a relative tolerance of 5% (``metadata.tolerance``);
- ``choice`` (``format: choice``): a shape scene whose most frequent colour is unique; "Which
  colour appears most often? (A) red (B) green (C) blue (D) yellow"; the answer is the letter.

Rows follow the prepared-data schema (``id``, ``messages``, ``prompt``, ``answer``, ``source``,
``metadata``) with one user turn ``[{"type": "image", "image": "images/<split>/<id>.png"},
{"type": "text", "text": question + " " + answer instruction}]``; image paths are relative to the
JSONL (:func:`saopd.prompts.vision.read_vision_rows` resolves them). ``metadata`` holds the
``format``, ``task``, the ``choices`` / ``tolerance`` a grader needs, and the scene (shapes,
bars) the answer was computed from.

Determinism: row ``i`` of split ``s`` draws from ``random.Random(seed * 1_000_003 + offset(s) +
i)``; drawing is integer-coordinate and aliased (no anti-aliasing), labels use PIL's built-in
bitmap font, PNGs are written without metadata at a fixed compression level. The same params and
Pillow build give the same bytes. The whole output folder is built in a temporary sibling folder
and swapped into place when complete, so a half-written dataset never appears at ``out_dir``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from saopd.io import encode_json_line, staged_folder
from saopd.stages.common import STAGES, PrepareError, param_section, resolve_path

if TYPE_CHECKING:
    from PIL import Image

__all__ = [
    "COLOURS",
    "SHAPES",
    "TASKS",
    "prepare_vlm",
    "render_chart",
    "render_choice",
    "render_count",
    "synth_rows",
]

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30),
}
SHAPES = ("circle", "square", "triangle")
BAR_LABELS = "ABCDE"
CHOICE_LETTERS = "ABCD"
SPLIT_OFFSETS = {"train": 0, "test": 500_000}
INSTRUCTIONS = {
    "count": "Answer with a single number.",
    "numeric": "Answer with a number.",
    "choice": "Answer with the letter of the correct option.",
}
GRID = 4  # shape scenes: GRID x GRID cells, at most one shape per cell
BACKGROUND = (255, 255, 255)

Task = Callable[[random.Random, int], tuple["Image.Image", str, str, dict[str, Any]]]


class SynthError(PrepareError):
    """A bad ``prepare_vlm`` parameter (a :class:`~saopd.stages.common.PrepareError`, so the
    command line reports it in one line)."""


# ----------------------------------------------------------------------------------- drawing


def _draw_shape(draw: Any, shape: str, box: tuple[int, int, int, int],
                colour: tuple[int, int, int]) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=colour)


def _scene(rng: random.Random, size: int, items: list[tuple[str, str]]
           ) -> tuple[Image.Image, list[dict[str, Any]]]:
    """Draw ``items`` (colour, shape) in distinct random cells of a GRID x GRID layout."""
    from PIL import Image, ImageDraw

    if len(items) > GRID * GRID:
        raise SynthError(f"a scene holds at most {GRID * GRID} shapes, got {len(items)}")
    img = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(img)
    cell = size // GRID
    cells = rng.sample(range(GRID * GRID), len(items))
    placed = []
    for (colour, shape), c in zip(items, cells, strict=True):
        side = rng.randint(cell * 5 // 10, cell * 8 // 10)
        x = (c % GRID) * cell + rng.randint(0, cell - side)
        y = (c // GRID) * cell + rng.randint(0, cell - side)
        _draw_shape(draw, shape, (x, y, x + side - 1, y + side - 1), COLOURS[colour])
        placed.append({"colour": colour, "shape": shape, "cell": c, "box": [x, y, side]})
    return img, placed


def _font() -> Any:
    from PIL import ImageFont

    loader = getattr(ImageFont, "load_default_imagefont", None)  # the bitmap font (Pillow >= 10.1)
    return loader() if loader is not None else ImageFont.load_default()


def render_count(rng: random.Random, size: int) -> tuple[Image.Image, str, str, dict[str, Any]]:
    """A shape scene and "How many <colour> <shape>s are there?"; answer: the count (1-5)."""
    colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
    k = rng.randint(1, 5)
    others = [(c, s) for c in sorted(COLOURS) for s in SHAPES if (c, s) != (colour, shape)]
    items = [(colour, shape)] * k + [rng.choice(others) for _ in range(rng.randint(1, 6))]
    rng.shuffle(items)
    img, placed = _scene(rng, size, items)
    question = f"How many {colour} {shape}s are there in the image?"
    return img, question, str(k), {"format": "count", "target": [colour, shape],
                                   "shapes": placed}


def render_choice(rng: random.Random, size: int) -> tuple[Image.Image, str, str, dict[str, Any]]:
    """A shape scene whose most frequent colour is unique; the answer is its option letter."""
    names = sorted(COLOURS)
    while True:
        counts = {c: rng.randint(0, 4) for c in names}
        top = max(counts.values())
        if top > 0 and list(counts.values()).count(top) == 1:
            break
    items = [(c, rng.choice(SHAPES)) for c, n in counts.items() for _ in range(n)]
    rng.shuffle(items)
    img, placed = _scene(rng, size, items)
    choices = names[:]
    rng.shuffle(choices)
    winner = max(counts, key=counts.__getitem__)
    options = " ".join(f"({letter}) {c}" for letter, c in zip(CHOICE_LETTERS, choices,
                                                              strict=True))
    question = f"Which colour appears most often in the image? {options}"
    answer = CHOICE_LETTERS[choices.index(winner)]
    return img, question, answer, {"format": "choice", "choices": choices, "counts": counts,
                                   "shapes": placed}


def render_chart(rng: random.Random, size: int) -> tuple[Image.Image, str, str, dict[str, Any]]:
    """A bar chart (3-5 bars A-E, integer values 1-9, axis 0-10 with labelled gridlines); the
    answer is one bar's value, graded with a 5% relative tolerance."""
    from PIL import Image, ImageDraw

    n = rng.randint(3, 5)
    values = [rng.randint(1, 9) for _ in range(n)]
    img = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(img)
    font = _font()
    left, right, top, bottom = size // 7, size - size // 14, size // 14, size - size // 7
    unit = (bottom - top) / 10
    for v in range(0, 11, 2):  # gridlines and tick labels every 2
        y = round(bottom - v * unit)
        draw.line([(left, y), (right, y)], fill=(200, 200, 200), width=1)
        draw.text((2, y - 5), str(v), fill=(0, 0, 0), font=font)
    draw.line([(left, top), (left, bottom), (right, bottom)], fill=(0, 0, 0), width=1)
    slot = (right - left) // n
    colour = COLOURS[rng.choice(sorted(COLOURS))]
    for i, v in enumerate(values):
        x0 = left + i * slot + slot // 4
        x1 = left + (i + 1) * slot - slot // 4
        draw.rectangle([x0, round(bottom - v * unit), x1, bottom - 1], fill=colour)
        draw.text(((x0 + x1) // 2 - 3, bottom + 4), BAR_LABELS[i], fill=(0, 0, 0), font=font)
    asked = rng.randrange(n)
    question = f"What is the value of bar {BAR_LABELS[asked]} in the bar chart?"
    return img, question, str(values[asked]), {
        "format": "numeric", "tolerance": 0.05,
        "bars": dict(zip(BAR_LABELS, values, strict=False)), "asked": BAR_LABELS[asked]}


#: Task name -> renderer ``(rng, image size) -> (image, question, answer, metadata)``.
TASKS: dict[str, Task] = {"count": render_count, "chart": render_chart, "choice": render_choice}


# -------------------------------------------------------------------------------------- rows


def _png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=9, optimize=False)
    return buf.getvalue()


def synth_rows(split: str, n: int, *, seed: int = 0, image_size: int = 224,
               tasks: tuple[str, ...] = tuple(TASKS)) -> list[tuple[dict[str, Any], bytes]]:
    """``n`` rows of ``split`` with their PNG bytes: ``[(row, png), ...]`` (module docstring).

    ``row["messages"]`` points at ``images/<split>/<id>.png`` relative to the JSONL.
    """
    if split not in SPLIT_OFFSETS:
        raise SynthError(f"split must be one of {list(SPLIT_OFFSETS)}, got {split!r}")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise SynthError(f"tasks must be a non-empty subset of {list(TASKS)}, got {list(tasks)}")
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 64:
        raise SynthError(f"image_size must be an int >= 64, got {image_size!r}")
    out = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        rng = random.Random(seed * 1_000_003 + SPLIT_OFFSETS[split] + i)
        img, question, answer, meta = TASKS[task](rng, image_size)
        fmt = meta["format"]
        rid = f"synth-{task}-{split}-{i}"
        rel = f"images/{split}/{rid}.png"
        text = f"{question} {INSTRUCTIONS[fmt]}"
        row = {
            "id": rid,
            "messages": [{"role": "user", "content": [{"type": "image", "image": rel},
                                                      {"type": "text", "text": text}]}],
            "prompt": question,
            "answer": answer,
            "source": f"synth_{task}",
            "metadata": {"task": task, "split": split, "index": i, "image_size": image_size,
                         **meta},
        }
        out.append((row, _png_bytes(img)))
    return out


# ------------------------------------------------------------------------------------- stage


def _int_param(cfg: Mapping[str, Any], key: str, default: int, minimum: int, where: str) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SynthError(f"{where}.{key} must be an int >= {minimum}, got {value!r}")
    return value


@STAGES.register("prepare_vlm")
def prepare_vlm(params: Mapping[str, Any], root: str | os.PathLike[str] = ".") -> dict[str, Any]:
    """Stage ``prepare_vlm``: render the splits of ``params["prepare_vlm"]`` into ``out_dir``.

    Keys: ``out_dir`` (required), ``seed`` (0), ``image_size`` (224), ``splits`` (``{train: n,
    test: m}``), ``tasks`` (default all of :data:`TASKS`). Writes ``<out_dir>/<split>.jsonl``,
    ``<out_dir>/images/<split>/*.png`` and ``<out_dir>/report.json`` (rows per split and task,
    sha256 of every JSONL and of the images) into a temporary folder, then swaps it in. Relative
    paths are taken from ``root``. Raises :class:`~saopd.stages.common.PrepareError` (a
    :class:`SynthError` for the rendering parameters) for a bad parameter.
    """
    where = "prepare_vlm"
    cfg = param_section(params, where, "params")
    out_dir = resolve_path(Path(root), cfg.get("out_dir"), f"{where}.out_dir")
    seed = _int_param(cfg, "seed", 0, 0, where)
    size = _int_param(cfg, "image_size", 224, 64, where)
    splits = cfg.get("splits", {"train": 240, "test": 60})
    if not isinstance(splits, Mapping) or not splits or set(splits) - set(SPLIT_OFFSETS):
        raise SynthError(f"{where}.splits must map some of {list(SPLIT_OFFSETS)} to row counts, "
                         f"got {splits!r}")
    tasks = tuple(cfg.get("tasks") or TASKS)
    from PIL import __version__ as pillow_version

    report: dict[str, Any] = {"stage": where, "seed": seed, "image_size": size,
                              "tasks": list(tasks), "pillow": pillow_version, "splits": {}}
    with staged_folder(out_dir) as tmp:
        for split, n in splits.items():
            n = _int_param(splits, split, 0, 1, f"{where}.splits")
            rows = synth_rows(split, n, seed=seed, image_size=size, tasks=tasks)
            images = hashlib.sha256()
            (tmp / "images" / split).mkdir(parents=True, exist_ok=True)
            for row, png in rows:
                rel = row["messages"][0]["content"][0]["image"]
                (tmp / rel).write_bytes(png)
                images.update(png)
            text = "".join(encode_json_line(row) for row, _ in rows).encode("utf-8")
            (tmp / f"{split}.jsonl").write_bytes(text)
            per_task: dict[str, int] = {}
            for row, _ in rows:
                per_task[row["metadata"]["task"]] = per_task.get(row["metadata"]["task"], 0) + 1
            report["splits"][split] = {
                "rows": n, "tasks": per_task, "jsonl_sha256": hashlib.sha256(text).hexdigest(),
                "images_sha256": images.hexdigest(),
            }
        (tmp / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report
