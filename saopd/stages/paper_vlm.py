"""DVC stages for the paper's vision-language training prompts (Appendix B).

- ``prepare_vlm_understanding``: a seeded 10% of VERO-600K's Captioning & IF, Grounding and
  Counting & Search rows (Sarch et al. 2026) -> ``data/prepared/vlm_understanding/``;
- ``prepare_vlm_reasoning``: a seeded 10% of MMRL30k (Shuffle-R1, Zhu et al. 2026) ->
  ``data/prepared/vlm_reasoning/``.

Each writes ``<out_dir>/train.jsonl``, its images and ``report.json``
(:func:`saopd.stages.vlm_rows.write_item_folder`) from the hub or a local export
(:mod:`saopd.stages.readers`; ``source: none``, the default in ``params.yaml``, prepares nothing).
The six benchmarks are :mod:`saopd.stages.vlm_eval`.

Sampling: rows are filtered (VERO-600K: category column in ``categories``), then
:func:`saopd.stages.common.seeded_sample` keeps ``round(fraction * n)`` of the ``n`` eligible rows
by the sha256 of ``"<seed>\\x1f<prompt text>\\x1f<answer>"``; only the kept rows' images are read.
A kept row that turns out bad (no image, an unreadable image, a placeholder count that does not
match the images) raises :class:`~saopd.stages.common.PrepareError` naming the row (``file[row
N]``, ``file:line`` or ``dataset[split][index]``) and the problem, or with ``skip_bad`` is
counted in the report and not replaced.

Columns are configurable (``columns`` of a stage's params, defaults in :data:`TRAIN_COLUMNS`; a
dotted name such as ``reward_model.ground_truth`` reads a nested field). What was confirmed, and
from where (the hub cannot be reached from here):

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
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from saopd.stages.common import (
    STAGES,
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
from saopd.stages.readers import Table, open_table, row_value, source_param
from saopd.stages.vlm_rows import (
    Item,
    as_list,
    maybe_json,
    require_text,
    with_instruction,
    write_item_folder,
    write_not_prepared,
)

__all__ = [
    "TRAIN_COLUMNS",
    "TRAIN_STAGES",
    "prepare_vlm_reasoning",
    "prepare_vlm_train",
    "prepare_vlm_understanding",
]

logger = logging.getLogger(__name__)

#: Training stage -> the dataset it prepares (the ids' prefix and its :data:`TRAIN_COLUMNS`).
TRAIN_STAGES = {"prepare_vlm_understanding": "vero", "prepare_vlm_reasoning": "mmrl30k"}

#: Default column names per dataset (overridden by ``columns`` in params.yaml).
TRAIN_COLUMNS: dict[str, dict[str, str]] = {
    "vero": {"prompt": "prompt", "images": "images", "answer": "reward_model.ground_truth",
             "category": "ability", "source": "data_source"},
    "mmrl30k": {"prompt": "problem", "images": "images", "answer": "answer"},
}


def _chat_text(value: Any) -> tuple[str, list[str]]:
    """A prompt column as (user text, system texts): a string, or chat messages (verl layout:
    ``[{"role": "system", ...}, {"role": "user", "content": "<image>..."}]``)."""
    value = maybe_json(value)
    if isinstance(value, str):
        return require_text(value, "prompt"), []
    if isinstance(value, list) and value and all(isinstance(m, Mapping) for m in value):
        system = [str(m.get("content") or "") for m in value if m.get("role") == "system"]
        users = [m.get("content") for m in value if m.get("role") == "user"]
        if len(users) != 1:
            raise ValueError(f"prompt messages need exactly one user turn, got {len(users)}")
        return require_text(users[0], "user turn"), [s for s in system if s.strip()]
    raise ValueError(f"prompt must be a string or a list of chat messages, got {value!r:.80}")


def _gold(value: Any) -> str:
    """A gold answer as text: strings stripped, numbers as :func:`answer_str`, lists/dicts as
    JSON (VERO-600K grounding answers are box lists)."""
    value = maybe_json(value) if not isinstance(value, str) else value
    if isinstance(value, list | dict):
        if not value:
            raise ValueError("the answer is empty")
        return json.dumps(value, ensure_ascii=False)
    return answer_str(value)


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
    text, system = _chat_text(row_value(row, cols["prompt"]))
    answer = _gold(row_value(row, cols["answer"]))
    images = as_list(row_value(row, cols["images"]))
    if not images:
        raise ValueError(f"no image in column {cols['images']!r}")
    meta: dict[str, Any] = {"index": index}
    for key in ("category", "source"):
        if key in cols:
            meta[key] = row_value(row, cols[key])
    return Item(f"{name}-{index}", with_instruction(text, instruction), images, answer, name,
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
    cols = {**TRAIN_COLUMNS[name], **(cfg.get("columns") or {})}
    chosen = source_param(cfg, stage)
    if chosen == "none":
        return write_not_prepared(out_dir, {"stage": stage})
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

    result = write_item_folder(out_dir, {"train": items}, report, skip_bad, table.base_dir,
                               make_report)
    logger.info("%s: %d rows in, %d eligible, %d sampled, %d written, %d skipped -> %s", stage,
                report.rows_in, len(eligible), len(keep), report.rows_out, report.skipped,
                out_dir)
    return result


@STAGES.register("prepare_vlm_understanding")
def prepare_vlm_understanding(params: Mapping[str, Any], root: Any = ".") -> dict[str, Any]:
    """Stage ``prepare_vlm_understanding``: the seeded sample of VERO-600K's three subsets."""
    return prepare_vlm_train(params, root, "prepare_vlm_understanding")


@STAGES.register("prepare_vlm_reasoning")
def prepare_vlm_reasoning(params: Mapping[str, Any], root: Any = ".") -> dict[str, Any]:
    """Stage ``prepare_vlm_reasoning``: the seeded sample of MMRL30k."""
    return prepare_vlm_train(params, root, "prepare_vlm_reasoning")
