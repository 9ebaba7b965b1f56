"""DVC stages for the paper's vision-language data: training prompts and six benchmarks.

Stages (``python -m saopd.stages.prepare <stage> --params params.yaml``; see ``dvc.yaml``):

- ``prepare_vlm_understanding``: a seeded 10% of VERO-600K's Captioning & IF, Grounding and
  Counting & Search rows (Sarch et al. 2026) -> ``data/prepared/vlm_understanding/``;
- ``prepare_vlm_reasoning``: a seeded 10% of MMRL30k (Shuffle-R1, Zhu et al. 2026) ->
  ``data/prepared/vlm_reasoning/``;
- ``prepare_vlm_eval``: EvoChart, MMIFEval, CountQA, MathVision, Geo3K and MathVista (testmini)
  -> ``data/prepared/vlm_eval/<name>.jsonl``, graded by ``saopd-eval`` (``metadata.format``).

Every stage writes ``<out_dir>/<file>.jsonl`` (the vision prompt schema of
:mod:`saopd.prompts.vision`: ``messages`` whose user turn holds ``{"type": "image", "image":
"images/..."}`` parts, paths relative to the JSONL, and text parts; ``answer`` the gold answer;
``metadata``), the images as files under ``<out_dir>/images/`` and ``<out_dir>/report.json``
(rows read, eligible, sampled, written, skipped with their reasons), into a temporary folder that
is swapped in whole. Every written row is checked by :func:`saopd.prompts.vision.validate_messages`
(images opened with PIL).

Sources (``source`` of a stage's params; a benchmark may set its own): ``none`` (the default in
``params.yaml``) prepares nothing: the stage writes only ``report.json`` saying so, so that an
offline ``dvc repro`` passes; the user chooses ``hub`` or ``local`` explicitly (``params.yaml`` or
``dvc exp run -S prepare_vlm_eval.source=hub``). ``hub`` loads ``hub.dataset`` (``hub.config``,
``hub.split``, ``hub.revision``: pin a commit for reproducibility) with Hugging Face
``datasets`` (imported only then; needs the network or a warm cache); ``local`` reads
``local.path``: a parquet file, a folder of parquet files (searched recursively, sorted; the
hub's own files or ``Dataset.to_parquet``), or a JSONL file whose image columns are paths
relative to the JSONL. Image values may be ``{"bytes": ..., "path": ...}`` dicts (what
``datasets``/parquet store), raw bytes, PIL images, base64 strings or file paths.

Sampling (training stages): rows are filtered (VERO-600K: category column in ``categories``),
then :func:`saopd.stages.prepare.seeded_sample` keeps ``round(fraction * n)`` of the ``n``
eligible rows by the sha256 of ``"<seed>\\x1f<prompt text>\\x1f<answer>"``; only the kept rows'
images are read. A kept row that turns out bad (no image, an unreadable image, a placeholder
count that does not match the images) raises :class:`~saopd.stages.prepare.PrepareError` naming
the row (``file[row N]``, ``file:line`` or ``dataset[split][index]``) and the problem, or with
``skip_bad`` is counted in the report and not replaced.

Columns are configurable (``columns`` of a dataset's params, defaults in
:data:`DEFAULT_COLUMNS`; a dotted name such as ``reward_model.ground_truth`` reads a nested
field). What was confirmed, and from where (the hub cannot be reached from here):

- MMRL30k (``XenoZLH/MMRL30k``, split ``train``): ``problem``/``answer``/``images``, from the
  Shuffle-R1 training scripts (EasyR1 ``data.train_files=XenoZLH/MMRL30k@train`` with EasyR1's
  ``prompt_key: problem``, ``answer_key: answer``, ``image_key: images``); ``<image>`` marks
  where each image goes. Confirmed.
- VERO-600K (``zlab-princeton/Vero-600k``): assumed to be in the verl layout of the derived
  ``ngqtrung/vero-rl`` set seen on the hub (``prompt``: chat messages, ``images``,
  ``data_source``, ``ability``: the category, ``reward_model.ground_truth``). The category
  values ``grounding_counting_search`` and ``captioning_instruction_following`` are assumed
  (that set writes ``knowledge_recognition`` for "Knowledge & Recognition"); the stage fails
  listing the values it found when none match.
- CountQA: ``image``, ``questions``/``answers`` (lists, one row per image), ``categories``,
  ``is_focused``, from EvalScope's CountQA adapter tests. Dataset id assumed.
- MathVista (``AI4Math/MathVista``, ``testmini``): ``pid``, ``query``, ``decoded_image``,
  ``choices``, ``answer``, ``question_type``, ``answer_type``, ``precision``, from lmms-eval's
  task. Confirmed.
- MathVision (``MathLLMs/MathVision``, ``test``): ``id``, ``question``, ``options``,
  ``decoded_image``, ``answer``, ``level``, ``subject``: assumed (dataset card as remembered).
- Geo3K (``hiyouga/geometry3k``, ``test``, 601 rows): ``images``/``problem``/``answer``, from
  its dataset card (and rLLM/EasyR1 recipes). Confirmed.
- MMIFEval: the official JSONL rows (MM-IFEngine ``eval_mmifeval``; lmms-eval/VLMEvalKit):
  ``id``, ``tag`` (C-Level/P-Level), ``infer_type`` (``main`` or ``aux_cmp_gpt``),
  ``instruction``, ``constraints`` (list or JSON text), ``question``, ``answer`` (P-Level list or
  JSON text), ``image`` (path, base64 text or bytes). Confirmed from the official code; no hub
  id is set (give ``hub.dataset`` or a local export).
- EvoChart: ``image``/``question``/``answer``: assumed; no hub id is set.

Grading formats (``metadata.format``; the paper's metrics, Appendix B): CountQA ``count`` (exact
match); MathVista multiple choice and MathVision questions with options ``choice`` (the gold
option letter; ``metadata.choices``); MathVista integer/float answers ``numeric`` (tolerance 0,
rounded to the row's ``precision``), its text answers ``text``; EvoChart numeric answers
``numeric`` (relaxed accuracy, 5%), others ``text``; MathVision free-form and Geo3K answers
(expressions such as ``2\\sqrt{3}``) carry no format and go to the math grader (math-verify);
MMIFEval ``mmifeval`` (:mod:`saopd.eval.mmifeval`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from saopd.io import encode_json_line, iter_jsonl_objects, staged_folder, write_json_atomic
from saopd.stages.prepare import (
    DEFAULT_INSTRUCTION,
    PrepareError,
    StageReport,
    answer_str,
    flag_param,
    instruction_param,
    param_section,
    require_param,
    resolve_path,
    seeded_sample,
    shown_path,
)

__all__ = [
    "BENCHMARK_CONVERTERS",
    "DEFAULT_COLUMNS",
    "VLM_STAGES",
    "Item",
    "hub_table",
    "image_bytes",
    "interleave",
    "local_table",
    "prepare_vlm_eval",
    "prepare_vlm_train",
]

logger = logging.getLogger(__name__)

VLM_STAGES = ("prepare_vlm_understanding", "prepare_vlm_reasoning", "prepare_vlm_eval")
TRAIN_STAGES = {"prepare_vlm_understanding": "vero", "prepare_vlm_reasoning": "mmrl30k"}
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

#: Default column names per dataset (overridden by ``columns`` in params.yaml).
DEFAULT_COLUMNS: dict[str, dict[str, str]] = {
    "vero": {"prompt": "prompt", "images": "images", "answer": "reward_model.ground_truth",
             "category": "ability", "source": "data_source"},
    "mmrl30k": {"prompt": "problem", "images": "images", "answer": "answer"},
    "countqa": {"image": "image", "questions": "questions", "answers": "answers",
                "categories": "categories", "is_focused": "is_focused"},
    "mathvista": {"id": "pid", "query": "query", "question": "question", "image": "decoded_image",
                  "choices": "choices", "answer": "answer", "question_type": "question_type",
                  "answer_type": "answer_type", "precision": "precision", "unit": "unit"},
    "mathvision": {"id": "id", "question": "question", "options": "options",
                   "image": "decoded_image", "answer": "answer", "level": "level",
                   "subject": "subject"},
    "geo3k": {"problem": "problem", "images": "images", "answer": "answer"},
    "evochart": {"id": "id", "image": "image", "question": "question", "answer": "answer"},
    "mmifeval": {"id": "id", "tag": "tag", "infer_type": "infer_type",
                 "instruction": "instruction", "constraints": "constraints",
                 "question": "question", "answer": "answer", "image": "image"},
}

_PLACEHOLDER = re.compile(r"<image\s*\d*>")
_IMAGE_EXT = {"PNG": "png", "JPEG": "jpg", "GIF": "gif", "WEBP": "webp", "BMP": "bmp",
              "TIFF": "tiff", "MPO": "jpg"}


# ------------------------------------------------------------------------------------ tables


@dataclass
class Table:
    """Rows of one source, read lazily: ``column(name)`` for the cheap first pass,
    ``rows(indices)`` for the rows kept. ``where(i)`` names row ``i`` in messages;
    ``base_dir`` resolves relative image paths (local JSONL)."""

    name: str
    size: int
    columns: list[str]
    _column: Callable[[str], list[Any]]
    _rows: Callable[[Sequence[int]], Iterator[dict[str, Any]]]
    _where: Callable[[int], str]
    base_dir: Path | None = None

    def __len__(self) -> int:
        return self.size

    def column(self, name: str) -> list[Any]:
        """Values of a column (a dotted name reads a nested field: ``a.b`` -> ``row[a][b]``)."""
        top, _, rest = name.partition(".")
        if top not in self.columns:
            raise PrepareError(f"{self.name}: no column {top!r} (columns: {self.columns}); "
                               "set the column names under `columns` in params.yaml")
        values = self._column(top)
        return [_dig(v, rest) for v in values] if rest else values

    def rows(self, indices: Sequence[int]) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(index, row)`` for each index, in the given order."""
        yield from zip(indices, self._rows(indices), strict=True)

    def where(self, index: int) -> str:
        return self._where(index)


def _dig(value: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        if isinstance(value, str) and value.lstrip().startswith("{"):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                return None
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def _get(row: Mapping[str, Any], name: str) -> Any:
    top, _, rest = name.partition(".")
    value = row.get(top)
    return _dig(value, rest) if rest else value


def local_table(path: Path, shown: str, report: StageReport, skip_bad: bool) -> Table:
    """A local export: a ``.parquet`` file, a folder of them, or a ``.jsonl`` file."""
    if path.is_file() and path.suffix == ".jsonl":
        return _jsonl_table(path, shown, report, skip_bad)
    if path.is_dir():
        files = sorted(path.rglob("*.parquet"))
        if not files:
            jsonl = sorted(path.rglob("*.jsonl"))
            if len(jsonl) == 1:
                return _jsonl_table(jsonl[0], shown_path(jsonl[0], path.parent), report, skip_bad)
            raise PrepareError(f"{shown}: no .parquet files (or one .jsonl file) in this folder")
    elif path.is_file() and path.suffix == ".parquet":
        files = [path]
    else:
        raise PrepareError(f"{shown}: local input not found or not .parquet/.jsonl "
                           f"({os.fspath(path)})")
    return _parquet_table(files, shown)


def _parquet_table(files: list[Path], shown: str) -> Table:
    import pyarrow.dataset as pads
    import pyarrow.parquet as pq

    counts = [pq.ParquetFile(f).metadata.num_rows for f in files]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    ds = pads.dataset([os.fspath(f) for f in files], format="parquet")
    names = [os.path.relpath(f, files[0].parent) if len(files) > 1 else f.name for f in files]

    def where(index: int) -> str:
        for f, start, n in zip(names, starts, counts, strict=True):
            if start <= index < start + n:
                return f"{shown}/{f}[row {index - start}]" if len(files) > 1 else \
                    f"{shown}[row {index - start}]"
        return f"{shown}[row {index}]"

    return Table(
        name=shown, size=sum(counts), columns=list(ds.schema.names),
        _column=lambda c: ds.to_table(columns=[c]).column(c).to_pylist(),
        _rows=lambda idx: iter(ds.take(list(idx)).to_pylist()) if idx else iter(()),
        _where=where,
    )


def _jsonl_table(path: Path, shown: str, report: StageReport, skip_bad: bool) -> Table:
    pairs = list(iter_jsonl_objects(path, lambda msg: report.bad(msg, skip_bad), name=shown))
    columns = sorted({k for _, row in pairs for k in row})
    return Table(
        name=shown, size=len(pairs), columns=columns,
        _column=lambda c: [row.get(c) for _, row in pairs],
        _rows=lambda idx: (pairs[i][1] for i in idx),
        _where=lambda i: f"{shown}:{pairs[i][0]}",
        base_dir=path.parent,
    )


_OFFLINE_HINT = ("To prepare it offline, download a snapshot elsewhere (the dataset's parquet "
                 "files, or `datasets.load_dataset(...).to_parquet(...)`), set `source: local` "
                 "and `local.path` in params.yaml.")


def _hf_load(dataset: str, config: str | None, split: str, revision: str | None) -> Any:
    """``datasets.load_dataset`` (imported here: only the hub source needs it)."""
    try:
        import datasets
    except ImportError:
        raise PrepareError(f"source 'hub' loads {dataset!r} with the Hugging Face `datasets` "
                           "package, which is not installed (pip install datasets). "
                           + _OFFLINE_HINT) from None
    try:
        return datasets.load_dataset(dataset, config, split=split, revision=revision)
    except Exception as e:
        raise PrepareError(f"{dataset!r} (config {config!r}, split {split!r}, revision "
                           f"{revision!r}) could not be loaded through `datasets` "
                           f"({type(e).__name__}: {e}); the hub is probably unreachable and the "
                           "dataset not cached. " + _OFFLINE_HINT) from e


def _undecoded_images(ds: Any) -> Any:
    """Image features cast to ``decode=False`` (``{"bytes", "path"}``: the stored bytes as
    they are, no re-encoding); datasets without image features are returned unchanged."""
    try:
        from datasets import Image as HFImage
        from datasets import Sequence as HFSequence
    except ImportError:  # a stand-in dataset in tests
        return ds
    for col, feat in dict(getattr(ds, "features", {}) or {}).items():
        inner = getattr(feat, "feature", None)
        if isinstance(feat, HFImage):
            ds = ds.cast_column(col, HFImage(decode=False))
        elif isinstance(feat, HFSequence) and isinstance(inner, HFImage):
            ds = ds.cast_column(col, HFSequence(HFImage(decode=False)))
        elif isinstance(feat, list) and feat and isinstance(feat[0], HFImage):
            ds = ds.cast_column(col, [HFImage(decode=False)])
        elif type(feat).__name__ == "List" and isinstance(inner, HFImage):
            ds = ds.cast_column(col, type(feat)(HFImage(decode=False)))
    return ds


def hub_table(hub: Mapping[str, Any], where: str) -> Table:
    """A hub dataset split through ``datasets`` (``hub: {dataset, config, split, revision}``)."""
    dataset = hub.get("dataset")
    if not isinstance(dataset, str) or not dataset:
        raise PrepareError(f"{where}.hub.dataset is not set: no hub id is known for this "
                           "dataset; set one, or use `source: local`. " + _OFFLINE_HINT)
    split = str(hub.get("split", "train"))
    config, revision = hub.get("config"), hub.get("revision")
    logger.info("%s: loading %s (config %s, split %s, revision %s) via `datasets`", where,
                dataset, config, split, revision)
    ds = _undecoded_images(_hf_load(dataset, config, split, revision))
    shown = f"{dataset}[{split}]"
    return Table(
        name=shown, size=len(ds), columns=list(ds.column_names),
        _column=lambda c: list(ds[c]),
        _rows=lambda idx: (dict(r) for r in ds.select(list(idx))),
        _where=lambda i: f"{shown}[{i}]",
    )


SOURCES = ("none", "hub", "local")


def _source(cfg: Mapping[str, Any], where: str, default: str | None = None) -> str:
    source = cfg.get("source", default)
    if source not in SOURCES:
        raise PrepareError(f"{where}.source must be one of {list(SOURCES)}, got {source!r}")
    return str(source)


def _not_prepared(out_dir: Path, report: dict[str, Any]) -> dict[str, Any]:
    """``source: none``: replace ``out_dir`` by a folder holding only ``report.json``."""
    where = report["stage"]
    report = {**report, "source": "none", "prepared": False, "message": (
        f"{where}: nothing prepared (source: none). Set {where}.source to 'hub' (needs the "
        "Hugging Face hub and `pip install datasets`) or 'local' (a downloaded snapshot) in "
        "params.yaml, then `dvc repro " + where + "`.")}
    logger.warning("%s", report["message"])
    with staged_folder(out_dir) as tmp:
        write_json_atomic(tmp / "report.json", report)
    return report


def open_table(cfg: Mapping[str, Any], where: str, root: Path, report: StageReport,
               skip_bad: bool, source: str) -> tuple[Table, dict[str, Any]]:
    """The table of a dataset's params for ``source`` (hub | local) and what to report of it."""
    if source == "hub":
        hub = cfg.get("hub") or {}
        table = hub_table(hub, where)
        return table, {"source": "hub", **{k: hub.get(k) for k in
                                           ("dataset", "config", "split", "revision")}}
    if source == "local":
        lcfg = param_section(cfg, "local", where)
        shown = require_param(lcfg, "path", f"{where}.local")
        path = resolve_path(root, shown, f"{where}.local.path")
        logger.info("%s: reading the local export %s", where, shown)
        return local_table(path, shown, report, skip_bad), {"source": "local", "path": shown}
    raise PrepareError(f"{where}.source must be 'hub' or 'local' here, got {source!r}")


# ------------------------------------------------------------------------------------ images


def image_bytes(value: Any, base_dir: Path | None = None) -> bytes:
    """The encoded bytes of one image value (module docstring); ``ValueError`` if none."""
    if isinstance(value, Mapping):
        if value.get("bytes"):
            return bytes(value["bytes"])
        if value.get("path"):
            return image_bytes(str(value["path"]), base_dir)
        raise ValueError(f"image dict has neither bytes nor path (keys: {sorted(value)})")
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if hasattr(value, "save") and hasattr(value, "mode"):  # a PIL image
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return buf.getvalue()
    if isinstance(value, str) and value:
        if value.startswith("data:") and "," in value:
            value = value.split(",", 1)[1]
        elif len(value) < 1024:
            path = Path(value)
            if not path.is_absolute() and base_dir is not None:
                path = base_dir / path
            if path.is_file():
                return path.read_bytes()
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"image {value[:60]!r} is neither a readable file nor base64 data"
                             ) from None
    raise ValueError(f"no image (got {type(value).__name__})")


def _image_ext(data: bytes) -> str:
    """The file extension of encoded image bytes; ``ValueError`` if PIL cannot read them."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt = img.format or "PNG"
            img.verify()
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise ValueError(f"image cannot be read ({type(e).__name__}: {e})") from None
    return _IMAGE_EXT.get(fmt, fmt.lower())


def _image_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return list(value)
    return [value]


def interleave(text: str, images: Sequence[str]) -> list[dict[str, str]]:
    """User-turn parts: the text with each ``<image>`` / ``<imageN>`` placeholder replaced by
    the next image part, in order; without placeholders, the images first, then the text.
    ``ValueError`` when placeholders exist but their count differs from the images'."""
    marks = list(_PLACEHOLDER.finditer(text))
    if not marks:
        return [{"type": "image", "image": p} for p in images] + [{"type": "text", "text": text}]
    if len(marks) != len(images):
        raise ValueError(f"the text has {len(marks)} <image> placeholder(s) but the row has "
                         f"{len(images)} image(s)")
    parts: list[dict[str, str]] = []
    start = 0
    for m, img in zip(marks, images, strict=True):
        piece = text[start:m.start()].strip()
        if piece:
            parts.append({"type": "text", "text": piece})
        parts.append({"type": "image", "image": img})
        start = m.end()
    tail = text[start:].strip()
    if tail:
        parts.append({"type": "text", "text": tail})
    return parts


# ------------------------------------------------------------------------------------- items


@dataclass
class Item:
    """One output row before its images are written: ``text`` (with optional placeholders),
    ``images`` (raw values), ``system`` (system turns' texts)."""

    id: str
    text: str
    images: list[Any]
    answer: str
    source: str
    metadata: dict[str, Any] = field(default_factory=dict)
    system: list[str] = field(default_factory=list)


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"missing or empty {what} (need a non-empty string, got "
                         f"{type(value).__name__})")
    return value


def _maybe_json(value: Any) -> Any:
    if isinstance(value, str) and value.strip()[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _chat_text(value: Any) -> tuple[str, list[str]]:
    """A prompt column as (user text, system texts): a string, or chat messages (verl layout:
    ``[{"role": "system", ...}, {"role": "user", "content": "<image>..."}]``)."""
    value = _maybe_json(value)
    if isinstance(value, str):
        return _text(value, "prompt"), []
    if isinstance(value, list) and value and all(isinstance(m, Mapping) for m in value):
        system = [str(m.get("content") or "") for m in value if m.get("role") == "system"]
        users = [m.get("content") for m in value if m.get("role") == "user"]
        if len(users) != 1:
            raise ValueError(f"prompt messages need exactly one user turn, got {len(users)}")
        return _text(users[0], "user turn"), [s for s in system if s.strip()]
    raise ValueError(f"prompt must be a string or a list of chat messages, got {value!r:.80}")


def _gold(value: Any) -> str:
    """A gold answer as text: strings stripped, numbers as :func:`answer_str`, lists/dicts as
    JSON (VERO-600K grounding answers are box lists)."""
    value = _maybe_json(value) if not isinstance(value, str) else value
    if isinstance(value, list | dict):
        if not value:
            raise ValueError("the answer is empty")
        return json.dumps(value, ensure_ascii=False)
    return answer_str(value)


def _with_instruction(text: str, instruction: str | None) -> str:
    return f"{text.strip()}\n{instruction}" if instruction else text.strip()


# --------------------------------------------------------------------------- training stages


def _train_key(table: Table, cols: Mapping[str, str], eligible: list[int], report: StageReport,
               skip_bad: bool) -> list[tuple[int, str]]:
    """``(index, sampling key)`` of the eligible rows; rows without text/answer are bad."""
    prompts, answers = table.column(cols["prompt"]), table.column(cols["answer"])
    keyed = []
    for i in eligible:
        try:
            text, _ = _chat_text(prompts[i])
            answer = _gold(answers[i])
        except ValueError as e:
            report.bad(f"{table.where(i)}: {e}", skip_bad)
            continue
        keyed.append((i, f"{text}\x1f{answer}"))
    return keyed


def _train_item(name: str, row: Mapping[str, Any], index: int, cols: Mapping[str, str],
                instruction: str | None) -> Item:
    text, system = _chat_text(_get(row, cols["prompt"]))
    answer = _gold(_get(row, cols["answer"]))
    images = _image_list(_get(row, cols["images"]))
    if not images:
        raise ValueError(f"no image in column {cols['images']!r}")
    meta: dict[str, Any] = {"index": index}
    for key in ("category", "source"):
        if key in cols:
            meta[key] = _get(row, cols[key])
    return Item(f"{name}-{index}", _with_instruction(text, instruction), images, answer, name,
                meta, system)


def prepare_vlm_train(params: Mapping[str, Any], root: Any = ".",
                      stage: str = "prepare_vlm_understanding") -> dict[str, Any]:
    """Stage ``prepare_vlm_understanding`` (VERO-600K) or ``prepare_vlm_reasoning`` (MMRL30k).

    Keys of ``params[stage]``: ``source`` (none | hub | local), ``hub``, ``local``, ``columns``,
    ``categories`` (VERO-600K: values of the category column to keep), ``fraction``, ``seed``,
    ``instruction``, ``skip_bad``, ``out_dir``. Writes ``<out_dir>/train.jsonl``, its images
    and ``report.json``; returns the report.
    """
    root = Path(root)
    if stage not in TRAIN_STAGES:
        raise PrepareError(f"unknown stage {stage!r}; training stages: {list(TRAIN_STAGES)}")
    name = TRAIN_STAGES[stage]
    cfg = param_section(params, stage, "params")
    skip_bad = flag_param(cfg, "skip_bad", stage)
    instruction = instruction_param(cfg, stage) if "instruction" in cfg else None
    out_dir = resolve_path(root, require_param(cfg, "out_dir", stage), f"{stage}.out_dir")
    try:
        fraction, seed = float(cfg.get("fraction", 0.1)), int(cfg.get("seed", 0))
    except (TypeError, ValueError) as e:
        raise PrepareError(f"{stage}: invalid fraction/seed ({e})") from e
    cols = {**DEFAULT_COLUMNS[name], **(cfg.get("columns") or {})}
    chosen = _source(cfg, stage)
    if chosen == "none":
        return _not_prepared(out_dir, {"stage": stage})
    report = StageReport(input="")
    table, source = open_table(cfg, stage, root, report, skip_bad, chosen)
    report.input = table.name
    report.rows_in = len(table)

    eligible = list(range(len(table)))
    per_category: dict[str, int] = {}
    if name == "vero":
        wanted = cfg.get("categories")
        if not isinstance(wanted, list) or not wanted:
            raise PrepareError(f"{stage}.categories must be a non-empty list of values of the "
                               f"{cols['category']!r} column")
        values = table.column(cols["category"])
        eligible = [i for i, v in enumerate(values) if v in wanted]
        for i in eligible:
            per_category[str(values[i])] = per_category.get(str(values[i]), 0) + 1
        if not eligible:
            found = sorted({str(v) for v in values})
            raise PrepareError(f"{table.name}: no row has {cols['category']!r} in {wanted}; "
                               f"values found: {found[:50]}; set {stage}.categories")
    try:
        keep = seeded_sample(_train_key(table, cols, eligible, report, skip_bad), fraction, seed)
    except PrepareError as e:
        raise PrepareError(f"{stage}: {e}") from None
    items: list[tuple[str, Item]] = []
    for index, row in table.rows(keep):
        try:
            items.append((table.where(index), _train_item(name, row, index, cols, instruction)))
        except ValueError as e:
            report.bad(f"{table.where(index)}: {e}", skip_bad)

    def make_report(written: dict[str, dict[str, Any]]) -> dict[str, Any]:
        return {
            "stage": stage, **source, "columns": cols, "fraction": fraction, "seed": seed,
            "instruction": instruction, "skip_bad": skip_bad, "rows_eligible": len(eligible),
            "categories": per_category or None, "rows_sampled": len(keep), **report.as_dict(),
            **written["train"], "output": shown_path(out_dir / "train.jsonl", root),
        }

    result = _write_folder(out_dir, {"train": items}, report, skip_bad, table.base_dir,
                           make_report)
    logger.info("%s: %d rows in, %d eligible, %d sampled, %d written, %d skipped -> %s", stage,
                report.rows_in, len(eligible), len(keep), report.rows_out, report.skipped,
                out_dir)
    return result


# ------------------------------------------------------------------------------ benchmarks

Converter = Callable[[Mapping[str, Any], int, Mapping[str, str], "str | None"], list[Item]]


def _count_gold(value: Any) -> str:
    text = answer_str(value)
    try:
        number = float(text.replace(",", ""))
    except ValueError:
        raise ValueError(f"count answer {text!r} is not a number") from None
    if not number.is_integer():
        raise ValueError(f"count answer {text!r} is not an integer")
    return str(int(number))


def _countqa(row: Mapping[str, Any], index: int, cols: Mapping[str, str],
             instruction: str | None) -> list[Item]:
    questions = _image_list(_maybe_json(_get(row, cols["questions"])))
    answers = _image_list(_maybe_json(_get(row, cols["answers"])))
    if not questions or len(questions) != len(answers):
        raise ValueError(f"needs as many answers as questions, got {len(questions)} question(s)"
                         f" and {len(answers)} answer(s)")
    image = _get(row, cols["image"])
    meta = {"categories": _get(row, cols.get("categories", "")),
            "is_focused": _get(row, cols.get("is_focused", ""))}
    return [Item(f"countqa-{index}-{j}", _with_instruction(_text(q, "question"), instruction),
                 [image], _count_gold(a), "countqa",
                 {"format": "count", "index": index, "question": j, **meta})
            for j, (q, a) in enumerate(zip(questions, answers, strict=True))]


def _options_text(options: Sequence[Any]) -> str:
    return "\n".join(f"({LETTERS[i]}) {opt}" for i, opt in enumerate(options))


def _mathvista(row: Mapping[str, Any], index: int, cols: Mapping[str, str],
               instruction: str | None) -> list[Item]:
    query = _get(row, cols["query"]) or _get(row, cols["question"])
    text = _text(query, "query/question")
    answer = answer_str(_get(row, cols["answer"]))
    qtype, atype = _get(row, cols["question_type"]), _get(row, cols["answer_type"])
    choices = _image_list(_maybe_json(_get(row, cols["choices"])))
    meta: dict[str, Any] = {"index": index, "native_id": _get(row, cols["id"]),
                            "question_type": qtype, "answer_type": atype}
    if qtype == "multi_choice":
        if answer not in [str(c).strip() for c in choices]:
            raise ValueError(f"multi_choice answer {answer!r} is not one of the choices "
                             f"{choices!r}")
        letter = LETTERS[[str(c).strip() for c in choices].index(answer)]
        meta.update(format="choice", choices=[str(c) for c in choices], answer_text=answer)
        answer = letter
    elif atype in ("integer", "float"):
        precision = _get(row, cols["precision"])
        meta.update(format="numeric", tolerance=0.0,
                    precision=int(precision) if atype == "float" and precision is not None
                    else (0 if atype == "integer" else None))
    else:
        meta.update(format="text")
    return [Item(f"mathvista-{index}", _with_instruction(text, instruction),
                 [_get(row, cols["image"])], answer, "mathvista", meta)]


def _mathvision(row: Mapping[str, Any], index: int, cols: Mapping[str, str],
                instruction: str | None) -> list[Item]:
    text = _text(_get(row, cols["question"]), "question")
    options = [str(o) for o in _image_list(_maybe_json(_get(row, cols["options"]))) if str(o)]
    answer = answer_str(_get(row, cols["answer"]))
    meta: dict[str, Any] = {"index": index, "native_id": _get(row, cols["id"]),
                            "level": _get(row, cols.get("level", "")),
                            "subject": _get(row, cols.get("subject", ""))}
    if options:
        letter = answer.strip().strip("()").upper()
        if len(letter) != 1 or letter not in LETTERS[:len(options)]:
            raise ValueError(f"answer {answer!r} is not an option letter for {len(options)} "
                             "options")
        text = f"{text.strip()}\n{_options_text(options)}"
        meta.update(format="choice", choices=options)
        answer = letter
    return [Item(f"mathvision-{index}", _with_instruction(text, instruction),
                 [_get(row, cols["image"])], answer, "mathvision", meta)]


def _geo3k(row: Mapping[str, Any], index: int, cols: Mapping[str, str],
           instruction: str | None) -> list[Item]:
    text = _text(_get(row, cols["problem"]), "problem")
    return [Item(f"geo3k-{index}", _with_instruction(text, instruction),
                 _image_list(_get(row, cols["images"])), answer_str(_get(row, cols["answer"])),
                 "geo3k", {"index": index})]


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").rstrip("%").strip())
    except ValueError:
        return None


def _evochart(row: Mapping[str, Any], index: int, cols: Mapping[str, str],
              instruction: str | None) -> list[Item]:
    text = _text(_get(row, cols["question"]), "question")
    answer = answer_str(_get(row, cols["answer"]))
    meta: dict[str, Any] = {"index": index, "native_id": _get(row, cols.get("id", ""))}
    meta.update({"format": "numeric", "tolerance": 0.05} if _number(answer) is not None
                else {"format": "text"})
    return [Item(f"evochart-{index}", _with_instruction(text, instruction),
                 [_get(row, cols["image"])], answer, "evochart", meta)]


def _mmifeval(row: Mapping[str, Any], index: int, cols: Mapping[str, str],
              instruction: str | None) -> list[Item]:
    from saopd.eval.mmifeval import check_constraints

    infer_type = _get(row, cols["infer_type"])
    if infer_type not in (None, "", "main"):
        return []  # aux_cmp_gpt: prompts without one constraint, for the official cmp_gpt judge
    tag = _get(row, cols["tag"])
    meta: dict[str, Any] = {"format": "mmifeval", "index": index, "tag": tag,
                            "native_id": _get(row, cols["id"])}
    answer = ""
    if tag == "P-Level":
        text = _text(_get(row, cols["question"]), "question")
        answers = _image_list(_maybe_json(_get(row, cols["answer"])))
        meta.update(question=text, answer_list=[str(a) for a in answers])
        answer = json.dumps(meta["answer_list"], ensure_ascii=False)
    else:
        constraints = _maybe_json(_get(row, cols["constraints"]))
        meta["constraints"] = constraints
        base = _text(_get(row, cols["instruction"]), "instruction")
        values = [str(c.get("value", "")) for c in constraints if isinstance(c, Mapping)] \
            if isinstance(constraints, list) else []
        text = base + "".join(f" {v}" for v in values)  # the official make_prompt_v2
    check_constraints(meta)
    return [Item(f"mmifeval-{index}", _with_instruction(text, instruction),
                 [_get(row, cols["image"])], answer, "mmifeval", meta)]


#: Benchmark name -> ``(row, index, columns, instruction) -> items``.
BENCHMARK_CONVERTERS: dict[str, Converter] = {
    "evochart": _evochart, "mmifeval": _mmifeval, "countqa": _countqa,
    "mathvision": _mathvision, "geo3k": _geo3k, "mathvista": _mathvista,
}


def prepare_vlm_eval(params: Mapping[str, Any], root: Any = ".") -> dict[str, Any]:
    """Stage ``prepare_vlm_eval``: convert each benchmark of ``params["prepare_vlm_eval"]``.

    Keys: ``source`` (none | hub | local: the benchmarks' default; ``none`` prepares nothing),
    ``out_dir``, ``skip_bad``, ``benchmarks: {name: {source, hub, local, columns,
    instruction, limit}}`` (names from :data:`BENCHMARK_CONVERTERS`; ``instruction`` defaults
    to the boxed-answer instruction, ``null`` for none; ``limit``: the first rows only). Writes
    ``<out_dir>/<name>.jsonl``, ``<out_dir>/images/<name>/`` and ``report.json``.
    """
    root = Path(root)
    where = "prepare_vlm_eval"
    cfg = param_section(params, where, "params")
    skip_bad = flag_param(cfg, "skip_bad", where)
    out_dir = resolve_path(root, require_param(cfg, "out_dir", where), f"{where}.out_dir")
    benchmarks = param_section(cfg, "benchmarks", where)
    unknown = sorted(set(benchmarks) - set(BENCHMARK_CONVERTERS))
    if unknown:
        raise PrepareError(f"{where}: unknown benchmark(s) {unknown}; known: "
                           f"{list(BENCHMARK_CONVERTERS)}")
    stage_source = None if cfg.get("source") is None else _source(cfg, where)
    if stage_source == "none":
        return _not_prepared(out_dir, {"stage": where})
    groups: dict[str, list[tuple[str, Item]]] = {}
    reports: dict[str, dict[str, Any]] = {}
    bases: dict[str, Path | None] = {}
    for name, bcfg in benchmarks.items():
        bwhere = f"{where}.benchmarks.{name}"
        if not isinstance(bcfg, dict):
            raise PrepareError(f"{bwhere}: expected a mapping with source, hub/local, columns")
        report = StageReport(input="")
        chosen = _source(bcfg, bwhere, stage_source)
        if chosen == "none":
            raise PrepareError(f"{bwhere}.source is 'none' but the stage's is "
                               f"{stage_source!r}; remove the benchmark or choose hub/local")
        table, source = open_table(bcfg, bwhere, root, report, skip_bad, chosen)
        report.input, report.rows_in = table.name, len(table)
        cols = {**DEFAULT_COLUMNS[name], **(bcfg.get("columns") or {})}
        # the boxed-answer instruction by default; none for MMIFEval (it would break its
        # constraints on how the response starts and ends)
        instruction = bcfg.get("instruction",
                               None if name == "mmifeval" else DEFAULT_INSTRUCTION)
        if instruction is not None and not isinstance(instruction, str):
            raise PrepareError(f"{bwhere}.instruction must be a string or null")
        limit = bcfg.get("limit")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or limit < 1):
            raise PrepareError(f"{bwhere}.limit must be an int >= 1 or null, got {limit!r}")
        indices = list(range(len(table) if limit is None else min(int(limit), len(table))))
        convert = BENCHMARK_CONVERTERS[name]
        items: list[tuple[str, Item]] = []
        dropped = 0
        for index, row in table.rows(indices):
            try:
                got = convert(row, index, cols, instruction)
            except (ValueError, TypeError, KeyError) as e:
                report.bad(f"{table.where(index)}: {e}", skip_bad)
                continue
            dropped += not got
            items.extend((table.where(index), item) for item in got)
        groups[name], bases[name] = items, table.base_dir
        reports[name] = {**source, "columns": cols, "instruction": instruction,
                         "report": report, "aux_rows_dropped": dropped}

    def make_report(written: dict[str, dict[str, Any]]) -> dict[str, Any]:
        out = {}
        for name, info in reports.items():
            rep: StageReport = info["report"]
            out[name] = {**{k: v for k, v in info.items() if k != "report"}, **rep.as_dict(),
                         **written[name], "output": shown_path(out_dir / f"{name}.jsonl", root)}
            logger.info("%s: %s: %d rows in, %d written, %d skipped", where, name,
                        rep.rows_in, rep.rows_out, rep.skipped)
        return {"stage": where, "skip_bad": skip_bad, "benchmarks": out}

    return _write_folder(out_dir, groups, {n: r["report"] for n, r in reports.items()},
                         skip_bad, bases, make_report)


# ------------------------------------------------------------------------------------ output


def _write_folder(out_dir: Path, groups: Mapping[str, list[tuple[str, Item]]],
                  reports: StageReport | Mapping[str, StageReport], skip_bad: bool,
                  base_dirs: Path | Mapping[str, Path | None] | None,
                  make_report: Callable[[dict[str, dict[str, Any]]], dict[str, Any]],
                  ) -> dict[str, Any]:
    """Write ``<group>.jsonl`` and ``images/`` for every group into a temporary folder beside
    ``out_dir``, check every row (:func:`saopd.prompts.vision.validate_messages`), write
    ``report.json`` (``make_report`` of the per-group sha256s and counts) and swap the folder
    in. Images go to ``images/<id>-<k>.<ext>`` (``images/<group>/`` when there are several
    groups). Bad rows go to the group's report (raise, or skip with ``skip_bad``). Returns the
    report."""
    from saopd.prompts.vision import validate_messages

    results: dict[str, dict[str, Any]] = {}
    with staged_folder(out_dir) as tmp:
        for group, items in groups.items():
            report = reports if isinstance(reports, StageReport) else reports[group]
            base = base_dirs if not isinstance(base_dirs, Mapping) else base_dirs[group]
            sub = f"images/{group}" if len(groups) > 1 else "images"
            (tmp / sub).mkdir(parents=True, exist_ok=True)
            lines: list[str] = []
            images_sha = hashlib.sha256()
            n_images = 0
            for where, item in items:
                try:
                    rels = []
                    for k, value in enumerate(item.images):
                        data = image_bytes(value, base)
                        rel = f"{sub}/{item.id}-{k}.{_image_ext(data)}"
                        (tmp / rel).write_bytes(data)
                        rels.append(rel)
                    if not rels:
                        raise ValueError("no image")
                    messages = [{"role": "system", "content": s} for s in item.system]
                    messages.append({"role": "user", "content": interleave(item.text, rels)})
                    validate_messages(messages, base_dir=tmp, where="messages")
                except ValueError as e:
                    report.bad(f"{where}: {e}", skip_bad)
                    continue
                for rel in rels:
                    images_sha.update((tmp / rel).read_bytes())
                n_images += len(rels)
                prompt = _PLACEHOLDER.sub("", item.text).strip()
                lines.append(encode_json_line({"id": item.id, "messages": messages, "prompt": prompt,
                                      "answer": item.answer, "source": item.source,
                                      "metadata": item.metadata}))
            text = "".join(lines).encode("utf-8")
            (tmp / f"{group}.jsonl").write_bytes(text)
            report.rows_out = len(lines)
            results[group] = {"rows_out": len(lines), "images": n_images,
                              "jsonl_sha256": hashlib.sha256(text).hexdigest(),
                              "images_sha256": images_sha.hexdigest()}
        result = make_report(results)
        write_json_atomic(tmp / "report.json", result)
    return result
