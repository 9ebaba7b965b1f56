"""DVC stage ``prepare_vlm_eval``: the paper's six vision-language benchmarks for ``saopd-eval``.

EvoChart, MMIFEval, CountQA, MathVision, Geo3K and MathVista (testmini) ->
``data/prepared/vlm_eval/<name>.jsonl``, their images under ``images/<name>/`` and
``report.json`` (:func:`saopd.stages.vlm_rows.write_item_folder`), from the hub or a local export
per benchmark (:mod:`saopd.stages.readers`; ``source: none``, the default in ``params.yaml``,
prepares nothing). One converter per benchmark (:data:`BENCHMARK_CONVERTERS`) turns a row into
zero or more items and says how the answer is graded (``metadata.format``).

Columns are configurable (``columns`` of a benchmark's params, defaults in
:data:`BENCHMARK_COLUMNS`). What was confirmed, and from where (the hub cannot be reached from
here):

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

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from saopd.stages.common import (
    DEFAULT_INSTRUCTION,
    STAGES,
    PrepareError,
    StageReport,
    answer_str,
    flag_param,
    param_section,
    require_param,
    resolve_path,
    shown_path,
)
from saopd.stages.readers import open_table, row_value, source_param
from saopd.stages.vlm_rows import (
    Item,
    as_list,
    maybe_json,
    require_text,
    with_instruction,
    write_item_folder,
    write_not_prepared,
)

__all__ = ["BENCHMARK_COLUMNS", "BENCHMARK_CONVERTERS", "prepare_vlm_eval"]

logger = logging.getLogger(__name__)

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

#: Default column names per benchmark (overridden by ``columns`` in params.yaml).
BENCHMARK_COLUMNS: dict[str, dict[str, str]] = {
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
    questions = as_list(maybe_json(row_value(row, cols["questions"])))
    answers = as_list(maybe_json(row_value(row, cols["answers"])))
    if not questions or len(questions) != len(answers):
        raise ValueError(f"needs as many answers as questions, got {len(questions)} question(s)"
                         f" and {len(answers)} answer(s)")
    image = row_value(row, cols["image"])
    meta = {"categories": row_value(row, cols.get("categories", "")),
            "is_focused": row_value(row, cols.get("is_focused", ""))}
    return [Item(f"countqa-{index}-{j}", with_instruction(require_text(q, "question"), instruction),
                 [image], _count_gold(a), "countqa",
                 {"format": "count", "index": index, "question": j, **meta})
            for j, (q, a) in enumerate(zip(questions, answers, strict=True))]


def _options_text(options: Sequence[Any]) -> str:
    return "\n".join(f"({LETTERS[i]}) {opt}" for i, opt in enumerate(options))


def _mathvista(row: Mapping[str, Any], index: int, cols: Mapping[str, str],
               instruction: str | None) -> list[Item]:
    query = row_value(row, cols["query"]) or row_value(row, cols["question"])
    text = require_text(query, "query/question")
    answer = answer_str(row_value(row, cols["answer"]))
    qtype, atype = row_value(row, cols["question_type"]), row_value(row, cols["answer_type"])
    choices = as_list(maybe_json(row_value(row, cols["choices"])))
    meta: dict[str, Any] = {"index": index, "native_id": row_value(row, cols["id"]),
                            "question_type": qtype, "answer_type": atype}
    if qtype == "multi_choice":
        if answer not in [str(c).strip() for c in choices]:
            raise ValueError(f"multi_choice answer {answer!r} is not one of the choices "
                             f"{choices!r}")
        letter = LETTERS[[str(c).strip() for c in choices].index(answer)]
        meta.update(format="choice", choices=[str(c) for c in choices], answer_text=answer)
        answer = letter
    elif atype in ("integer", "float"):
        precision = row_value(row, cols["precision"])
        meta.update(format="numeric", tolerance=0.0,
                    precision=int(precision) if atype == "float" and precision is not None
                    else (0 if atype == "integer" else None))
    else:
        meta.update(format="text")
    return [Item(f"mathvista-{index}", with_instruction(text, instruction),
                 [row_value(row, cols["image"])], answer, "mathvista", meta)]


def _mathvision(row: Mapping[str, Any], index: int, cols: Mapping[str, str],
                instruction: str | None) -> list[Item]:
    text = require_text(row_value(row, cols["question"]), "question")
    options = [str(o) for o in as_list(maybe_json(row_value(row, cols["options"]))) if str(o)]
    answer = answer_str(row_value(row, cols["answer"]))
    meta: dict[str, Any] = {"index": index, "native_id": row_value(row, cols["id"]),
                            "level": row_value(row, cols.get("level", "")),
                            "subject": row_value(row, cols.get("subject", ""))}
    if options:
        letter = answer.strip().strip("()").upper()
        if len(letter) != 1 or letter not in LETTERS[:len(options)]:
            raise ValueError(f"answer {answer!r} is not an option letter for {len(options)} "
                             "options")
        text = f"{text.strip()}\n{_options_text(options)}"
        meta.update(format="choice", choices=options)
        answer = letter
    return [Item(f"mathvision-{index}", with_instruction(text, instruction),
                 [row_value(row, cols["image"])], answer, "mathvision", meta)]


def _geo3k(row: Mapping[str, Any], index: int, cols: Mapping[str, str],
           instruction: str | None) -> list[Item]:
    text = require_text(row_value(row, cols["problem"]), "problem")
    images = as_list(row_value(row, cols["images"]))
    answer = answer_str(row_value(row, cols["answer"]))
    return [Item(f"geo3k-{index}", with_instruction(text, instruction), images, answer, "geo3k",
                 {"index": index})]


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").rstrip("%").strip())
    except ValueError:
        return None


def _evochart(row: Mapping[str, Any], index: int, cols: Mapping[str, str],
              instruction: str | None) -> list[Item]:
    text = require_text(row_value(row, cols["question"]), "question")
    answer = answer_str(row_value(row, cols["answer"]))
    meta: dict[str, Any] = {"index": index, "native_id": row_value(row, cols.get("id", ""))}
    meta.update({"format": "numeric", "tolerance": 0.05} if _number(answer) is not None
                else {"format": "text"})
    return [Item(f"evochart-{index}", with_instruction(text, instruction),
                 [row_value(row, cols["image"])], answer, "evochart", meta)]


def _mmifeval(row: Mapping[str, Any], index: int, cols: Mapping[str, str],
              instruction: str | None) -> list[Item]:
    from saopd.eval.mmifeval import check_constraints  # saopd.eval: only this converter

    infer_type = row_value(row, cols["infer_type"])
    if infer_type not in (None, "", "main"):
        return []  # aux_cmp_gpt: prompts without one constraint, for the official cmp_gpt judge
    tag = row_value(row, cols["tag"])
    meta: dict[str, Any] = {"format": "mmifeval", "index": index, "tag": tag,
                            "native_id": row_value(row, cols["id"])}
    answer = ""
    if tag == "P-Level":
        text = require_text(row_value(row, cols["question"]), "question")
        answers = as_list(maybe_json(row_value(row, cols["answer"])))
        meta.update(question=text, answer_list=[str(a) for a in answers])
        answer = json.dumps(meta["answer_list"], ensure_ascii=False)
    else:
        constraints = maybe_json(row_value(row, cols["constraints"]))
        meta["constraints"] = constraints
        base = require_text(row_value(row, cols["instruction"]), "instruction")
        values = [str(c.get("value", "")) for c in constraints if isinstance(c, Mapping)] \
            if isinstance(constraints, list) else []
        text = base + "".join(f" {v}" for v in values)  # the official make_prompt_v2
    check_constraints(meta)
    return [Item(f"mmifeval-{index}", with_instruction(text, instruction),
                 [row_value(row, cols["image"])], answer, "mmifeval", meta)]


#: Benchmark name -> ``(row, index, columns, instruction) -> items``.
BENCHMARK_CONVERTERS: dict[str, Converter] = {
    "evochart": _evochart, "mmifeval": _mmifeval, "countqa": _countqa,
    "mathvision": _mathvision, "geo3k": _geo3k, "mathvista": _mathvista,
}


@STAGES.register("prepare_vlm_eval")
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
    stage_source = None if cfg.get("source") is None else source_param(cfg, where)
    if stage_source == "none":
        return write_not_prepared(out_dir, {"stage": where})
    groups: dict[str, list[tuple[str, Item]]] = {}
    reports: dict[str, dict[str, Any]] = {}
    bases: dict[str, Path | None] = {}
    for name, bcfg in benchmarks.items():
        bwhere = f"{where}.benchmarks.{name}"
        if not isinstance(bcfg, dict):
            raise PrepareError(f"{bwhere}: expected a mapping with source, hub/local, columns")
        report = StageReport(input="")
        chosen = source_param(bcfg, bwhere, stage_source)
        if chosen == "none":
            raise PrepareError(f"{bwhere}.source is 'none' but the stage's is "
                               f"{stage_source!r}; remove the benchmark or choose hub/local")
        table, source = open_table(bcfg, bwhere, root, report, skip_bad, chosen)
        report.input, report.rows_in = table.name, len(table)
        cols = {**BENCHMARK_COLUMNS[name], **(bcfg.get("columns") or {})}
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

    return write_item_folder(out_dir, groups, {n: r["report"] for n, r in reports.items()},
                             skip_bad, bases, make_report)
