"""The math stages of the DVC pipeline: the evaluation benchmarks and the training prompts.

Run as ``python -m saopd.stages <stage> --params params.yaml`` (``dvc repro`` does this, see
``dvc.yaml``). Relative paths in the params file are resolved against the params file's folder
(the repository root for ``params.yaml``).

Both stages write one JSON object per line, in one schema::

    {"id": str, "messages": [{"role": "user", "content": problem + "\\n" + instruction}],
     "prompt": problem, "answer": gold answer (str), "source": dataset name, "metadata": {...}}

``prompt`` is the problem stripped of surrounding whitespace. Ids: ``<benchmark>-<line - 1>``
(the 0-based row of the vendored file, also ``metadata["index"]``; ``metadata["line"]`` is the
1-based line), ``deepmath-<row of the split>``, ``gsm8k-train-<line>``.

``prepare_eval`` (:func:`prepare_eval`) normalises the vendored benchmarks in
``data/benchmarks`` (see its ``PROVENANCE.md``) to ``<out_dir>/<name>.jsonl``:

- every input file's sha256 and row count are checked against the params first; a mismatch
  raises :class:`~saopd.stages.common.PrepareError` naming the file, the expected and the actual
  value;
- ``aime25``: the upstream defect where ``\\f`` of ``\\frac`` became U+000C and ``\\t`` of
  ``\\triangle`` became U+0009 is repaired on ``problem`` (rows 18, 27 and 19);
- ``amc23``: float answers become integers when integral (``27.0`` -> ``"27"``);
- ``minerva_math``: the gold answer is the content of the last ``\\boxed{...}`` of the
  solution (balanced braces, :func:`last_boxed`);
- ``aime24``/``aime25``: the answer is kept as given (``"025"``), ``metadata["answer_int"]`` holds
  it as an integer string (``"25"``).

``prepare_train`` (:func:`prepare_train`) writes ``<out>`` (``data/prepared/train/train.jsonl``)
from ``source: deepmath`` (``zwhe99/DeepMath-103K`` through Hugging Face ``datasets``, imported
only on that path; rows with ``difficulty >= min_difficulty`` and a seeded ``fraction`` of them)
or ``source: local`` (a local JSONL, by default the vendored GSM8K train split read with
:func:`saopd.prompts.text.gsm8k_records`, which imports torch: only that path does). The source
is always logged and written to the report.

Bad input (a line that is not valid UTF-8/JSON or not an object, a missing or invalid field)
raises :class:`~saopd.stages.common.PrepareError` naming ``file:line``; with ``skip_bad: true``
the row is skipped and counted in the stage's ``report.json``. Every output is written to a
temporary file in the same folder and moved into place with :func:`os.replace`, and a stage
writes nothing until all of its inputs were read and checked, so no half-written file ever
appears.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from saopd.io import PathLike, write_json_atomic, write_jsonl_atomic
from saopd.latex import last_boxed
from saopd.stages.common import (
    MAX_REPORTED_ERRORS,
    STAGES,
    PrepareError,
    StageReport,
    answer_str,
    flag_param,
    instruction_param,
    iter_jsonl,
    optional_int_param,
    param_section,
    require_param,
    resolve_path,
    seeded_sample,
    shown_path,
    verify_input,
)

__all__ = [
    "BENCHMARKS",
    "DEEPMATH_COLUMNS",
    "deepmath_records",
    "make_record",
    "prepare_eval",
    "prepare_train",
    "repair_aime25_problem",
]

logger = logging.getLogger(__name__)

#: Columns of ``zwhe99/DeepMath-103K`` that are read. The dataset (one ``train`` split, about
#: 103k rows) also has ``r1_solution_1..3``, three long DeepSeek-R1 solutions, which are not
#: loaded. The names follow the dataset card as remembered, not a download (the hub cannot be
#: reached here); ``question``/``final_answer``/``difficulty`` are checked when the dataset is
#: loaded, and a mismatch raises an error listing the columns found.
DEEPMATH_COLUMNS = ("question", "final_answer", "difficulty", "topic")


# ----------------------------------------------------------------------------------- records


def make_record(
    id: str,
    problem: str,
    answer: str,
    source: str,
    instruction: str | None,
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One output row of the common schema.

    ``prompt`` is ``problem`` stripped of surrounding whitespace; the single user message is
    ``prompt + "\\n" + instruction`` (the bare prompt when ``instruction`` is empty or ``None``).
    """
    prompt = problem.strip()
    content = f"{prompt}\n{instruction}" if instruction else prompt
    return {
        "id": id,
        "messages": [{"role": "user", "content": content}],
        "prompt": prompt,
        "answer": answer,
        "source": source,
        "metadata": dict(metadata or {}),
    }


def repair_aime25_problem(problem: str) -> tuple[str, dict[str, int]]:
    """Undo the upstream AIME25 defect: U+000C -> ``\\f`` and U+0009 -> ``\\t``.

    (``"\\frac"`` and ``"\\triangle"`` were written into JSON unescaped, so ``\\f``/``\\t``
    became a form feed/tab.) Returns the repaired text and the number of each repair made, e.g.
    ``{"\\\\f": 5}``; an empty dict when nothing was changed.
    """
    counts = {"\\f": problem.count("\x0c"), "\\t": problem.count("\t")}
    repaired = problem.replace("\x0c", "\\f").replace("\t", "\\t")
    return repaired, {k: v for k, v in counts.items() if v}


def _int_str(answer: str) -> str:
    """An integer answer string without zero padding (``"025"`` -> ``"25"``)."""
    try:
        return str(int(answer))
    except ValueError:
        raise ValueError(f"answer {answer!r} is not an integer") from None


def _problem(row: Mapping[str, Any], key: str = "problem") -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(
            f"missing or empty field {key!r} (need a non-empty string; keys: {sorted(row)})"
        )
    return value


def _field(row: Mapping[str, Any], key: str) -> Any:
    if key not in row or row[key] is None:
        raise ValueError(f"missing field {key!r} (keys: {sorted(row)})")
    return row[key]


# ------------------------------------------------------------------------------- benchmarks

Normaliser = Callable[[Mapping[str, Any], int, str | None], dict[str, Any]]


def _math500(row: Mapping[str, Any], index: int, instruction: str | None) -> dict[str, Any]:
    meta = {k: row.get(k) for k in ("unique_id", "subject", "level", "solution")}
    return make_record(
        f"math500-{index}", _problem(row), answer_str(_field(row, "answer")), "math500",
        instruction, meta,
    )


def _aime24(row: Mapping[str, Any], index: int, instruction: str | None) -> dict[str, Any]:
    answer = answer_str(_field(row, "answer"))
    meta = {
        "native_id": row.get("id"), "answer_int": _int_str(answer), "url": row.get("url"),
        "solution": row.get("solution"),
    }
    return make_record(f"aime24-{index}", _problem(row), answer, "aime24", instruction, meta)


def _aime25(row: Mapping[str, Any], index: int, instruction: str | None) -> dict[str, Any]:
    answer = answer_str(_field(row, "answer"))
    problem, repairs = repair_aime25_problem(_problem(row))
    meta = {"native_id": row.get("id"), "answer_int": _int_str(answer), "repairs": repairs}
    return make_record(f"aime25-{index}", problem, answer, "aime25", instruction, meta)


def _amc23(row: Mapping[str, Any], index: int, instruction: str | None) -> dict[str, Any]:
    raw = _field(row, "answer")
    meta = {"native_id": row.get("id"), "answer_raw": raw, "url": row.get("url")}
    return make_record(
        f"amc23-{index}", _problem(row), answer_str(raw), "amc23", instruction, meta
    )


def _minerva_math(row: Mapping[str, Any], index: int, instruction: str | None) -> dict[str, Any]:
    solution = _problem(row, "solution")
    answer = last_boxed(solution)
    if not answer:
        raise ValueError("the solution has no closed, non-empty \\boxed{...} for the answer")
    meta = {"idx": row.get("idx"), "type": row.get("type"), "solution": solution}
    return make_record(
        f"minerva_math-{index}", _problem(row), answer, "minerva_math", instruction, meta
    )


#: Benchmark name -> row normaliser ``(row, 0-based index, instruction) -> record``.
BENCHMARKS: dict[str, Normaliser] = {
    "math500": _math500,
    "aime24": _aime24,
    "aime25": _aime25,
    "amc23": _amc23,
    "minerva_math": _minerva_math,
}


# ------------------------------------------------------------------------------ prepare_eval


@STAGES.register("prepare_eval")
def prepare_eval(params: Mapping[str, Any], root: PathLike = ".") -> dict[str, Any]:
    """Stage ``prepare_eval``: normalise every benchmark of ``params["prepare_eval"]``.

    Keys: ``instruction``, ``skip_bad``, ``out_dir`` and ``benchmarks: {name: {path, sha256,
    rows}}`` (``name`` one of :data:`BENCHMARKS`). Inputs are all verified and converted in
    memory before the first file is written; then ``<out_dir>/<name>.jsonl`` and
    ``<out_dir>/report.json`` are written atomically. Relative paths are taken from ``root``.
    Returns the report.
    """
    root = Path(root)
    where = "prepare_eval"
    cfg = param_section(params, "prepare_eval", "params")
    instruction = instruction_param(cfg, where)
    skip_bad = flag_param(cfg, "skip_bad", where)
    out_dir = resolve_path(root, require_param(cfg, "out_dir", where), f"{where}.out_dir")
    benchmarks = param_section(cfg, "benchmarks", where)
    unknown = sorted(set(benchmarks) - set(BENCHMARKS))
    if unknown:
        raise PrepareError(f"{where}: unknown benchmark(s) {unknown}; known: {list(BENCHMARKS)}")

    outputs: dict[str, list[dict[str, Any]]] = {}
    reports: dict[str, dict[str, Any]] = {}
    for name, bcfg in benchmarks.items():
        bwhere = f"{where}.benchmarks.{name}"
        if not isinstance(bcfg, dict):
            raise PrepareError(f"{bwhere}: expected a mapping with path, sha256 and rows")
        shown = require_param(bcfg, "path", bwhere)
        path = resolve_path(root, shown, f"{bwhere}.path")
        sha, n_rows = verify_input(
            path, sha256=bcfg.get("sha256"), rows=optional_int_param(bcfg, "rows", bwhere),
            name=shown,
        )
        report = StageReport(input=shown, rows_in=n_rows)
        records: list[dict[str, Any]] = []
        normalise = BENCHMARKS[name]
        for lineno, row in iter_jsonl(path, report, skip_bad, name=shown):
            try:
                rec = normalise(row, lineno - 1, instruction)
            except ValueError as e:
                report.bad(f"{shown}:{lineno}: {e}", skip_bad)
                continue
            rec["metadata"] = {"index": lineno - 1, "line": lineno, **rec["metadata"]}
            records.append(rec)
        report.rows_out = len(records)
        outputs[name] = records
        entry = report.as_dict()
        entry["input_sha256"] = sha
        if name == "aime25":
            entry["repaired_rows"] = [
                r["metadata"]["index"] for r in records if r["metadata"]["repairs"]
            ]
        reports[name] = entry

    for name, records in outputs.items():
        out = out_dir / f"{name}.jsonl"
        reports[name]["output"] = shown_path(out, root)
        reports[name]["output_sha256"] = write_jsonl_atomic(out, records)
        logger.info(
            "prepare_eval: %s: %d rows in, %d out, %d skipped -> %s", name,
            reports[name]["rows_in"], len(records), reports[name]["skipped"], out,
        )
    result = {
        "stage": "prepare_eval", "instruction": instruction, "skip_bad": skip_bad,
        "benchmarks": reports,
    }
    write_json_atomic(out_dir / "report.json", result)
    return result


# ----------------------------------------------------------------------------- prepare_train


def deepmath_records(
    rows: Iterable[tuple[int, Mapping[str, Any]]],
    *,
    min_difficulty: float,
    fraction: float,
    seed: int,
    instruction: str | None,
    skip_bad: bool,
    report: StageReport,
    where: str,
    line_numbers: bool = False,
) -> tuple[list[dict[str, Any]], int]:
    """Filter DeepMath rows to ``difficulty >= min_difficulty`` and keep a seeded ``fraction``.

    ``rows`` are ``(index, row)`` pairs (0-based index in the split, or line - 1 in a local
    file); rows have DeepMath-103K's columns ``question``, ``final_answer``, ``difficulty``
    (``topic`` optional). A row with a missing/empty question or answer or a non-numeric
    difficulty raises :class:`PrepareError` naming ``<where>[<index>]`` (``<where>:<line>`` with
    ``line_numbers``), or is counted in ``report`` with ``skip_bad``.

    Of the ``n`` eligible rows, ``round(fraction * n)`` are kept: those with the smallest sha256
    of ``"<seed>\\x1f<question>"`` (ties by index). The sample thus depends only on the seed and
    the rows (not on the Python/NumPy version or the row order). Records keep the dataset's
    order; ``id`` is ``deepmath-<index>`` and ``answer`` is ``final_answer``. Returns
    ``(records, n_eligible)``.
    """
    if not 0.0 < fraction <= 1.0:
        raise PrepareError(f"{where}: fraction must be in (0, 1], got {fraction!r}")
    eligible: list[tuple[int, dict[str, Any]]] = []
    for index, row in rows:
        at = f"{where}:{index + 1}" if line_numbers else f"{where}[{index}]"
        try:
            question = _problem(row, "question")
            answer = answer_str(_field(row, "final_answer"))
            difficulty = _field(row, "difficulty")
            if isinstance(difficulty, bool) or not isinstance(difficulty, int | float):
                raise ValueError(f"difficulty must be a number, got {difficulty!r}")
        except ValueError as e:
            report.bad(f"{at}: {e}", skip_bad)
            continue
        if difficulty >= min_difficulty:
            meta = {"index": index, "difficulty": difficulty, "topic": row.get("topic")}
            rec = make_record(f"deepmath-{index}", question, answer, "deepmath", instruction, meta)
            eligible.append((index, rec))
    by_index = dict(eligible)
    keep = seeded_sample(((i, rec["prompt"]) for i, rec in eligible), fraction, seed)
    return [by_index[i] for i in keep], len(eligible)


_OFFLINE_HINT = (
    "To prepare training data offline, set `prepare_train.source: local` in params.yaml (the "
    "vendored GSM8K train split by default, or a local JSONL export of DeepMath-103K with "
    "`prepare_train.local.format: deepmath`)."
)


def _load_hf_rows(dataset: str, split: str, revision: str | None) -> list[dict[str, Any]]:
    """Rows of a Hugging Face dataset split, only :data:`DEEPMATH_COLUMNS`, via ``datasets``.

    ``datasets`` is imported here, so the rest of the module works without it. A missing
    package or a failed load raises :class:`PrepareError` saying so and suggesting
    ``source: local``.
    """
    try:
        import datasets  # lazy: optional dependency, only this source needs it
    except ImportError:
        raise PrepareError(
            f"prepare_train.source is 'deepmath', which loads {dataset!r} with the Hugging Face "
            "`datasets` package, but `datasets` is not installed (pip install datasets). "
            + _OFFLINE_HINT
        ) from None
    try:
        ds = datasets.load_dataset(dataset, split=split, revision=revision)
    except Exception as e:
        raise PrepareError(
            f"prepare_train.source is 'deepmath' but {dataset!r} (split {split!r}, revision "
            f"{revision!r}) could not be loaded through `datasets` ({type(e).__name__}: {e}). "
            "The Hugging Face hub is probably unreachable (no network, or HF_HUB_OFFLINE / "
            "HF_DATASETS_OFFLINE set) and the dataset is not in the local cache. " + _OFFLINE_HINT
        ) from e
    names = list(getattr(ds, "column_names", None) or [])
    missing = [c for c in ("question", "final_answer", "difficulty") if c not in names]
    if missing:
        raise PrepareError(
            f"{dataset!r} (split {split!r}) has no column(s) {missing}; columns: {names}"
        )
    if hasattr(ds, "select_columns"):  # leave out r1_solution_1..3 (long texts)
        ds = ds.select_columns([c for c in DEEPMATH_COLUMNS if c in names])
    return [dict(row) for row in ds]


def _sample_args(dm: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``min_difficulty``, ``fraction`` and ``seed`` of the ``deepmath`` params (defaults 6, 0.3,
    0)."""
    try:
        return {
            "min_difficulty": float(dm.get("min_difficulty", 6)),
            "fraction": float(dm.get("fraction", 0.3)),
            "seed": int(dm.get("seed", 0)),
        }
    except (TypeError, ValueError) as e:
        raise PrepareError(f"{where}: invalid min_difficulty/fraction/seed ({e})") from e


@STAGES.register("prepare_train")
def prepare_train(params: Mapping[str, Any], root: PathLike = ".") -> dict[str, Any]:
    """Stage ``prepare_train``: write the training prompts from ``params["prepare_train"]``.

    Keys: ``source`` (``deepmath`` or ``local``, required), ``instruction``, ``skip_bad``,
    ``out``, ``deepmath: {dataset, split, revision, min_difficulty, fraction, seed}`` and
    ``local: {path, format (gsm8k | deepmath), sha256, rows}``. A local ``format: deepmath``
    file gets the same difficulty filter and sample as the hub dataset. The source is logged and
    recorded in the report. Writes ``out`` and ``report.json`` beside it atomically, after all
    input was read; returns the report.
    """
    root = Path(root)
    where = "prepare_train"
    cfg = param_section(params, "prepare_train", "params")
    source = require_param(cfg, "source", where)
    if source not in ("deepmath", "local"):
        raise PrepareError(f"{where}.source must be 'deepmath' or 'local', got {source!r}")
    instruction = instruction_param(cfg, where)
    skip_bad = flag_param(cfg, "skip_bad", where)
    out = resolve_path(root, require_param(cfg, "out", where), f"{where}.out")
    dm = cfg.get("deepmath") or {}
    extra: dict[str, Any] = {"source": source}

    if source == "deepmath":
        dataset = str(dm.get("dataset", "zwhe99/DeepMath-103K"))
        split = str(dm.get("split", "train"))
        revision = dm.get("revision")
        logger.info("prepare_train: source=deepmath (%s, split %s, revision %s) via `datasets`",
                    dataset, split, revision)
        args = _sample_args(dm, f"{where}.deepmath")
        rows = _load_hf_rows(dataset, split, revision)
        report = StageReport(input=f"hf:{dataset}[{split}]@{revision or 'default'}",
                             rows_in=len(rows))
        records, eligible = deepmath_records(
            enumerate(rows), instruction=instruction, skip_bad=skip_bad, report=report,
            where=f"{dataset}[{split}]", **args,
        )
        extra.update({"dataset": dataset, "split": split, "revision": revision, **args,
                      "rows_eligible": eligible})
    else:
        lcfg = param_section(cfg, "local", where)
        shown = require_param(lcfg, "path", f"{where}.local")
        path = resolve_path(root, shown, f"{where}.local.path")
        fmt = lcfg.get("format", "gsm8k")
        if fmt not in ("gsm8k", "deepmath"):
            raise PrepareError(f"{where}.local.format must be 'gsm8k' or 'deepmath', got {fmt!r}")
        logger.info("prepare_train: source=local (%s, format %s)", shown, fmt)
        sha, n_rows = verify_input(
            path, sha256=lcfg.get("sha256"),
            rows=optional_int_param(lcfg, "rows", f"{where}.local"), name=shown,
        )
        extra.update({"format": fmt, "input_sha256": sha})
        report = StageReport(input=shown, rows_in=n_rows)
        if fmt == "gsm8k":
            records = _gsm8k_local(path, shown, instruction, skip_bad, report)
        else:
            args = _sample_args(dm, f"{where}.deepmath")
            pairs = [(n - 1, row) for n, row in iter_jsonl(path, report, skip_bad, name=shown)]
            records, eligible = deepmath_records(
                pairs, instruction=instruction, skip_bad=skip_bad, report=report, where=shown,
                line_numbers=True, **args,
            )
            extra.update({**args, "rows_eligible": eligible})

    report.rows_out = len(records)
    sha_out = write_jsonl_atomic(out, records)
    result = {
        "stage": "prepare_train", **extra, "instruction": instruction, "skip_bad": skip_bad,
        **report.as_dict(), "output": shown_path(out, root), "output_sha256": sha_out,
    }
    write_json_atomic(out.parent / "report.json", result)
    logger.info("prepare_train: %d rows in, %d out, %d skipped -> %s",
                report.rows_in, report.rows_out, report.skipped, out)
    return result


def _gsm8k_local(
    path: Path, shown: str, instruction: str | None, skip_bad: bool, report: StageReport
) -> list[dict[str, Any]]:
    """GSM8K JSONL -> records through :func:`saopd.prompts.text.gsm8k_records` (the bare
    question as ``prompt``, the number after the last ``####`` as ``answer``, its id
    ``gsm8k-train-<line>``). Errors name ``<shown>:<line>``."""
    from saopd.prompts.text import gsm8k_records  # imports torch: only this path needs it

    full = os.fspath(path)
    try:
        recs, read = gsm8k_records(path, instruction=None, skip_bad=skip_bad, split="train")
    except ValueError as e:
        raise PrepareError(str(e).replace(full, shown, 1)) from e
    report.skipped = read.skipped
    report.errors = [m.replace(full, shown, 1) for m in read.errors[:MAX_REPORTED_ERRORS]]
    return [
        make_record(rec.id, rec.messages[-1]["content"], rec.answer or "", "gsm8k", instruction,
                    {"line": int(rec.id.rsplit("-", 1)[1])})
        for rec in recs
    ]
