"""What every DVC stage shares: the stage registry, errors and reports, input checks, the params
helpers and the one seeded sampler.

A stage is a function ``(params, root) -> report`` registered under its ``dvc.yaml`` name with
``@STAGES.register("<name>")``; ``params`` is the whole ``params.yaml`` mapping, ``root`` the
folder relative paths in it are taken from (the params file's folder), and the returned report is
what the stage also wrote to its ``report.json``. The command line (``python -m saopd.stages``)
looks the stage up in :data:`STAGES`.

Bad input or a bad parameter raises :class:`PrepareError` with a message naming the file and
line (``file:line``), the row (``file[row N]``) or the parameter (``stage.key``); with
``skip_bad: true`` a bad row is counted in the stage's :class:`StageReport` instead.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from saopd.io import PathLike, file_sha256, iter_jsonl_objects
from saopd.registry import Registry

__all__ = [
    "DEFAULT_INSTRUCTION",
    "MAX_REPORTED_ERRORS",
    "STAGES",
    "PrepareError",
    "Stage",
    "StageReport",
    "answer_str",
    "flag_param",
    "instruction_param",
    "iter_jsonl",
    "load_params",
    "optional_int_param",
    "param_section",
    "require_param",
    "resolve_path",
    "seeded_sample",
    "shown_path",
    "verify_input",
]

logger = logging.getLogger(__name__)

#: ``(params, root) -> report``: one DVC stage (module docstring).
Stage = Callable[[Mapping[str, Any], Path], dict[str, Any]]

#: The DVC stages by their ``dvc.yaml`` name; importing :mod:`saopd.stages` registers them all.
STAGES: Registry[Any] = Registry("DVC stage")

#: Default instruction appended (after a newline) to every problem; ``params.yaml`` sets it too.
DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

#: At most this many bad-row messages are kept in a report (the count is always exact).
MAX_REPORTED_ERRORS = 100


class PrepareError(ValueError):
    """A data preparation error: bad input, a checksum/row-count mismatch or a bad parameter."""


# ------------------------------------------------------------------------------------ report


@dataclass
class StageReport:
    """Counts for one input of a stage, written into the stage's ``report.json``."""

    input: str
    rows_in: int = 0
    rows_out: int = 0
    skipped: int = 0
    errors: list[str] = field(default_factory=list)

    def bad(self, msg: str, skip_bad: bool) -> None:
        """Raise :class:`PrepareError` with ``msg``, or count it when ``skip_bad``."""
        if not skip_bad:
            raise PrepareError(msg)
        self.skipped += 1
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(msg)
        logger.warning("skipped: %s", msg)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready counts (``errors`` holds at most :data:`MAX_REPORTED_ERRORS` messages)."""
        return {
            "input": self.input, "rows_in": self.rows_in, "rows_out": self.rows_out,
            "skipped": self.skipped, "errors": list(self.errors),
        }


def shown_path(path: Path, root: Path) -> str:
    """``path`` relative to ``root`` when it lies below it (reports stay machine-independent)."""
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return os.fspath(path)


# ------------------------------------------------------------------------------------- input


def _count_rows(path: PathLike) -> int:
    """Non-blank lines of a JSONL file (the rows, good or bad)."""
    with open(path, "rb") as fh:
        return sum(1 for raw in fh if raw.strip())


def verify_input(
    path: PathLike, *, sha256: str | None, rows: int | None, name: str | None = None
) -> tuple[str, int]:
    """Check a file's sha256 and row count (non-blank lines) against the expected values.

    ``None`` skips a check (a warning is logged). Raises :class:`PrepareError` naming the file
    (``name``, default the path), the expected and the actual value on a mismatch, or if the
    file does not exist. Returns ``(sha256, rows)`` as found.
    """
    shown = name or os.fspath(path)
    if not Path(path).is_file():
        raise PrepareError(f"{shown}: input file not found ({os.fspath(path)})")
    got_sha, got_rows = file_sha256(path), _count_rows(path)
    if sha256 is None:
        logger.warning("%s: no expected sha256 given, not checked (sha256 %s)", shown, got_sha)
    elif got_sha != sha256.lower():
        raise PrepareError(f"{shown}: sha256 mismatch: expected {sha256}, got {got_sha}")
    if rows is None:
        logger.warning("%s: no expected row count given, not checked (%d rows)", shown, got_rows)
    elif got_rows != rows:
        raise PrepareError(f"{shown}: row count mismatch: expected {rows} rows, got {got_rows}")
    return got_sha, got_rows


def iter_jsonl(
    path: PathLike, report: StageReport, skip_bad: bool, name: str | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, object)`` per non-blank line (1-based; a UTF-8 BOM is dropped).

    A line that is not valid UTF-8 or JSON, or not a JSON object, raises
    ``PrepareError("<name>:<line>: ...")``, or is counted in ``report`` when ``skip_bad``
    (the reader is :func:`saopd.io.iter_jsonl_objects`).
    """
    return iter_jsonl_objects(path, lambda msg: report.bad(msg, skip_bad), name=name)


def answer_str(value: Any) -> str:
    """A gold answer as a string: str stripped, int as is, integral float as int (``27.0`` ->
    ``"27"``), other floats with ``repr``. Raises ``ValueError`` for anything else or empty."""
    if isinstance(value, bool):
        raise ValueError(f"answer must be a string or a number, got {value!r}")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"answer is not finite: {value!r}")
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise ValueError(f"answer must be a non-empty string or a number, got {value!r}")


# ------------------------------------------------------------------------------------ params


def load_params(path: PathLike) -> dict[str, Any]:
    """Read a YAML params file (a mapping at the top level)."""
    try:
        with open(path, encoding="utf-8") as fh:
            params = yaml.safe_load(fh)
    except FileNotFoundError:
        raise PrepareError(f"params file not found: {os.fspath(path)}") from None
    if not isinstance(params, dict):
        raise PrepareError(f"{os.fspath(path)}: expected a mapping at the top level")
    return params


def param_section(params: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    """``params[key]``, which must be a mapping; ``where`` names ``params`` in the error."""
    value = params.get(key)
    if not isinstance(value, dict):
        raise PrepareError(f"{where}: missing or invalid section {key!r} (expected a mapping)")
    return value


def require_param(cfg: Mapping[str, Any], key: str, where: str) -> Any:
    """``cfg[key]``; a missing key raises :class:`PrepareError` naming ``where`` and ``key``."""
    if key not in cfg:
        raise PrepareError(f"{where}: missing parameter {key!r}")
    return cfg[key]


def optional_int_param(cfg: Mapping[str, Any], key: str, where: str) -> int | None:
    """``cfg[key]`` as an int >= 0, or ``None`` when absent or null."""
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PrepareError(f"{where}: {key!r} must be an int >= 0 or null, got {value!r}")
    return value


def flag_param(cfg: Mapping[str, Any], key: str, where: str) -> bool:
    """A boolean parameter (default ``False``); a YAML string like ``"false"`` is an error."""
    value = cfg.get(key, False)
    if not isinstance(value, bool):
        raise PrepareError(f"{where}: {key!r} must be true or false, got {value!r}")
    return value


def instruction_param(cfg: Mapping[str, Any], where: str) -> str | None:
    """The ``instruction`` parameter: a string, or null/empty for the bare problem."""
    value = cfg.get("instruction", DEFAULT_INSTRUCTION)
    if value is not None and not isinstance(value, str):
        raise PrepareError(f"{where}: 'instruction' must be a string or null, got {value!r}")
    return value


def resolve_path(root: Path, value: Any, where: str) -> Path:
    """A path parameter: a non-empty string, taken relative to ``root`` unless absolute."""
    if not isinstance(value, str) or not value:
        raise PrepareError(f"{where}: expected a path string, got {value!r}")
    path = Path(value)
    return path if path.is_absolute() else root / path


# ---------------------------------------------------------------------------------- sampling


def _sample_rank(seed: int, key: str, index: int) -> tuple[str, int]:
    """Sort key of the seeded sample: sha256 of ``"<seed>\\x1f<key>"``, then the index."""
    return hashlib.sha256(f"{seed}\x1f{key}".encode()).hexdigest(), index


def seeded_sample(keyed: Iterable[tuple[int, str]], fraction: float, seed: int) -> list[int]:
    """The indices of a seeded ``fraction`` of ``(index, key)`` pairs, in increasing order.

    Of the ``n`` pairs, ``round(fraction * n)`` are kept: those with the smallest sha256 of
    ``"<seed>\\x1f<key>"`` (ties by index). The sample thus depends only on the seed and the
    keys (not on the Python/NumPy version or the row order), and a row's membership does not
    change when unrelated rows are added (beyond the count). The one sampler of the data stages
    (DeepMath, VERO-600K, MMRL30k). Raises :class:`PrepareError` for ``fraction`` outside
    ``(0, 1]``.
    """
    if not 0.0 < fraction <= 1.0:
        raise PrepareError(f"fraction must be in (0, 1], got {fraction!r}")
    pairs = list(keyed)
    k = round(fraction * len(pairs))
    ranked = sorted(pairs, key=lambda item: _sample_rank(seed, item[1], item[0]))
    return sorted(index for index, _ in ranked[:k])
