"""A dataset's rows from the Hugging Face hub or a local export, read lazily: the sources of the
paper's VLM stages (:mod:`saopd.stages.paper_vlm`, :mod:`saopd.stages.vlm_eval`).

Sources (``source`` of a stage's params; a benchmark may set its own): ``none`` (the default in
``params.yaml``) prepares nothing: the stage writes only ``report.json`` saying so, so that an
offline ``dvc repro`` passes; the user chooses ``hub`` or ``local`` explicitly (``params.yaml`` or
``dvc exp run -S prepare_vlm_eval.source=hub``). ``hub`` loads ``hub.dataset`` (``hub.config``,
``hub.split``, ``hub.revision``: pin a commit for reproducibility) with Hugging Face
``datasets`` (imported only then; needs the network or a warm cache); ``local`` reads
``local.path``: a parquet file, a folder of parquet files (searched recursively, sorted; the
hub's own files or ``Dataset.to_parquet``), or a JSONL file whose image columns are paths
relative to the JSONL. Hub image features are read undecoded (``{"bytes", "path"}``: the stored
bytes as they are).

A :class:`Table` is read in two passes: ``column(name)`` for the cheap first pass (filtering and
sampling), ``rows(indices)`` for the rows kept, so only those rows' images are loaded. Column
names may be dotted (``reward_model.ground_truth`` reads a nested field, :func:`row_value`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from saopd.io import iter_jsonl_objects
from saopd.stages.common import (
    PrepareError,
    StageReport,
    param_section,
    require_param,
    resolve_path,
    shown_path,
)

__all__ = [
    "SOURCES",
    "Table",
    "hub_table",
    "local_table",
    "open_table",
    "row_value",
    "source_param",
]

logger = logging.getLogger(__name__)

#: The values of a stage's (or a benchmark's) ``source`` parameter.
SOURCES = ("none", "hub", "local")


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
        """Row ``index`` as error messages name it (``file[row N]``, ``file:line``, ...)."""
        return self._where(index)


def _dig(value: Any, dotted: str) -> Any:
    """``value[a][b]...`` for ``dotted == "a.b..."`` (JSON text objects are parsed on the way);
    ``None`` where a level is missing."""
    for key in dotted.split("."):
        if isinstance(value, str) and value.lstrip().startswith("{"):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                return None
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def row_value(row: Mapping[str, Any], name: str) -> Any:
    """The value of column ``name`` in ``row`` (dotted: a nested field; ``None`` if absent)."""
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


def source_param(cfg: Mapping[str, Any], where: str, default: str | None = None) -> str:
    """The ``source`` parameter (one of :data:`SOURCES`; ``default`` when absent)."""
    source = cfg.get("source", default)
    if source not in SOURCES:
        raise PrepareError(f"{where}.source must be one of {list(SOURCES)}, got {source!r}")
    return str(source)


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

