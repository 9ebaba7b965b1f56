"""``saopd-report``: the paper's tables and figures from MLflow runs.

    saopd-report -e tiny                                   # every run of experiment 'tiny'
    saopd-report -t study=math -t sweep=main               # runs carrying these tags
    saopd-report -e math --reference Student=<run id> --reference Teacher=<run id>
    saopd-report -e math --benchmarks math500,amc23,aime25,aime24,minerva_math --spread ci95
    saopd-report -e tiny --no-table --token-records        # dynamics and token statistics only

Reads the selected runs (``--experiment``, ``--tag``, ``--run``) from the MLflow store
(``--tracking-uri``; default ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<repo>/mlflow.db``,
where ``saopd-train`` logs) and writes to ``--out`` (default ``<repo>/outputs/reports/<time>``):

- ``results.md`` / ``results.tex`` / ``results.html``: rows = methods (from each run's filter
  and objective, or its ``method`` tag), columns = the ``eval/<benchmark>/avg_at_<k>`` metrics,
  ``Avg.`` and ``Δ OPD``; seeds averaged with their spread; best bold, second underlined
  (:mod:`saopd.analysis.tables`);
- ``training_dynamics.png``: |Δ loss| and FLMR over steps per run (the paper's Figure 4);
- ``entropy_over_steps.png`` when the runs logged ``train/entropy_student_filtered`` /
  ``_kept``, and with ``--token-records``: ``token_statistics_<method>.{md,tex,html}`` (Table 4)
  and ``entropy_<method>.png`` (Figure 3b, when the records carry the student entropy);
- ``sources.csv`` (the runs used) and ``report.json`` (files, notes, MLflow run).

- ``accuracy_over_steps.png``: each benchmark's held-out score over the steps trained, per
  method the mean over its seeds with a 95% band (:func:`saopd.analysis.plots.
  over_steps_figure`), when the runs evaluated during training.

Tables show mean ± 95% CI over seeds (``--spread``) with the seed count, rounded to the
intervals (``--decimals``), bold only where a method's interval separates (``--marks``).
Nothing is logged to MLflow unless asked: ``--log-to report`` logs everything to a new run of
experiment ``reports``; ``runs`` also adds each training run's own dynamics figure to it under
``report/``. Bad input (no runs, unknown experiment, no score metric)
exits with status 2 and a message naming the problem.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from saopd.paths import repo_root
from saopd.runs.tracking import check_tracking_server

__all__ = ["build_parser", "main", "run_report"]


class ReportError(ValueError):
    """Bad input for the report: printed without a traceback, exit status 2."""


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``saopd-report``."""
    p = argparse.ArgumentParser(
        prog="saopd-report", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Tables: mean ± 95%% CI over seeds; a method in bold where its interval lies "
               "above every other method's (references excluded); values are the latest eval "
               "metric of each run, x --scale.")
    sel = p.add_argument_group("which runs")
    sel.add_argument("--tracking-uri", default=None,
                     help="MLflow store (default: $MLFLOW_TRACKING_URI, else "
                          "sqlite:///<repo>/mlflow.db)")
    sel.add_argument("-e", "--experiment", action="append", default=[], metavar="NAME",
                     help="MLflow experiment name (repeatable)")
    sel.add_argument("-t", "--tag", action="append", default=[], type=_key_value,
                     metavar="KEY=VALUE", help="only runs with this tag (repeatable: all must "
                     "match), e.g. study=math, sweep=main, filter=sa_opd")
    sel.add_argument("--run", action="append", default=[], metavar="RUN_ID",
                     help="a run id (repeatable); with -e/-t: narrows their selection")
    sel.add_argument("--reference", action="append", default=[], type=_key_value,
                     metavar="LABEL=RUN_ID", help="a reference row shown above the methods and "
                     "not ranked, e.g. Student=<eval run>; repeat a label for several seeds")
    sel.add_argument("--include-unfinished", action="store_true",
                     help="also RUNNING, FAILED and KILLED runs, flagged in their labels "
                     "(default: FINISHED runs only; a run killed with -9 stays RUNNING)")
    sel.add_argument("--label-tag", default="method",
                     help="run tag that names a run's method when set (default: method)")

    tab = p.add_argument_group("table")
    tab.add_argument("--benchmarks", default=None,
                     help="comma-separated benchmarks (name or name@k), in column order "
                          "(default: every eval metric found, paper order)")
    tab.add_argument("--baseline", default="OPD", help="method of the gain column (default OPD:"
                     " filter=none, objective=sampled)")
    tab.add_argument("--highlight", default="SA-OPD",
                     help="method shown last, shaded, with a per-benchmark gain row")
    tab.add_argument("--spread", choices=("std", "ci95"), default="ci95",
                     help="seed spread: 95%% CI half-width of the mean (t; default) or the "
                          "sample std")
    tab.add_argument("--marks", choices=("interval", "rank"), default="interval",
                     help="interval (default): bold only where a method's 95%% interval lies "
                          "above every other's; rank: best bold, second underlined")
    tab.add_argument("--scale", type=float, default=100.0,
                     help="multiply scores (fractions) by this (default 100: percent)")
    tab.add_argument("--decimals", type=int, default=None,
                     help="digits after the point (default: two significant digits of the "
                          "smallest 95%% interval; 1 without intervals)")
    tab.add_argument("--caption", default=None, help="table caption")
    tab.add_argument("--no-table", action="store_true",
                     help="no results table (runs without eval metrics: figures only)")

    fig = p.add_argument_group("figures and token statistics")
    fig.add_argument("--smooth", type=int, default=1,
                     help="moving-average window for the dynamics curves (default 1: none)")
    fig.add_argument("--token-records", action="store_true",
                     help="read the runs' token_records/ artifacts: Table 4 token statistics "
                          "and the entropy distribution per method")
    fig.add_argument("--all-token-steps", action="store_true",
                     help="with --token-records: every recorded step (default: each run's last)")

    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, default=None,
                     help="output folder (default <repo>/outputs/reports/<YYYYmmdd-HHMMSS>)")
    out.add_argument("--log-to", choices=("report", "runs", "none"), default="none",
                     help="none: no MLflow logging (default); report: a new run in "
                          "--report-experiment holds every file; runs: that, and each source "
                          "run gets its own dynamics figure under report/")
    out.add_argument("--report-experiment", default="reports",
                     help="MLflow experiment of the report run (default: reports)")
    return p


def run_report(args: argparse.Namespace) -> dict[str, Any]:
    """Build the report described by parsed ``args``; returns a summary (files, notes, runs).

    Raises :class:`ReportError` for bad input.
    """
    import pandas as pd

    from saopd.analysis.collect import (
        UNFINISHED,
        NoRunsError,
        RunQuery,
        benchmark_columns,
        column_label,
        load_runs,
        method_labels,
        mlflow_client,
        run_seeds,
        unfinished_runs,
    )

    check_tracking_server(args.tracking_uri)  # a server that does not answer: one line, now
    client = mlflow_client(args.tracking_uri)
    statuses = None if args.include_unfinished else ("FINISHED",)
    query = RunQuery(experiments=tuple(args.experiment), tags=dict(args.tag),
                     run_ids=tuple(args.run), statuses=statuses)
    notes: list[str] = []
    if not args.include_unfinished:  # say what was left out: a dead run never stands in
        left_out = unfinished_runs(client, dataclasses.replace(query, statuses=UNFINISHED))
        if left_out:
            notes.append(f"{sum(left_out.values())} unfinished run(s) left out ("
                         + ", ".join(f"{n} {s}" for s, n in sorted(left_out.items()))
                         + "; a RUNNING run may be training still or have died without being "
                         "marked): --include-unfinished shows them, flagged")
    references: dict[str, list[str]] = {}
    for label, run_id in args.reference:
        references.setdefault(label, []).append(run_id)
    ref_ids = [i for ids in references.values() for i in ids]
    try:
        runs = load_runs(client, query)
        runs = runs[~runs["run_id"].isin(ref_ids)]
        if runs.empty:
            raise NoRunsError(f"only reference runs match {query.describe()}")
        if ref_ids:
            refs = load_runs(client, RunQuery(run_ids=tuple(ref_ids), statuses=None))
            runs = pd.concat([runs, refs], ignore_index=True)
    except NoRunsError as err:
        raise ReportError(str(err)) from None
    runs = runs.reset_index(drop=True)
    labels = method_labels(runs, label_tag=args.label_tag)
    unfinished = runs["status"] != "FINISHED"
    labels[unfinished] = [f"{lab} [{st}]" for lab, st in
                          zip(labels[unfinished], runs.loc[unfinished, "status"], strict=True)]
    for label, ids in references.items():
        labels[runs["run_id"].isin(ids)] = label
    seeds = run_seeds(runs)

    # one run per (method, seed): a later run of the same method and seed replaces an older one
    # (an unfinished run has its own, flagged label: it never replaces a finished one)
    is_ref = runs["run_id"].isin(ref_ids)
    key = pd.Series([f"{lab}\0{s}" if s is not None else rid for lab, s, rid in
                     zip(labels, seeds, runs["run_id"], strict=True)], index=runs.index)
    dup = ~is_ref & key.duplicated(keep="last")
    for i in runs.index[dup]:
        notes.append(f"run {runs.at[i, 'run_id']} ({labels[i]}, seed {seeds[i]}) replaced by a "
                     "later run of the same method and seed")
    runs, labels, seeds = runs[~dup], labels[~dup], seeds[~dup]

    out = Path(args.out) if args.out else repo_root() / "outputs" / "reports" / time.strftime(
        "%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    summary: dict[str, Any] = {"output_dir": str(out), "runs": len(runs), "notes": notes,
                               "tracking_uri": getattr(client, "tracking_uri", None)}

    if not args.no_table:
        from saopd.analysis.reporting import scores_frame, write_table_files
        from saopd.analysis.tables import results_table

        wanted = [b.strip() for b in args.benchmarks.split(",") if b.strip()] \
            if args.benchmarks else None
        try:
            cols = benchmark_columns(runs, wanted)
        except NoRunsError as err:
            raise ReportError(f"{err} (or pass --no-table for figures only)") from None
        scores = scores_frame(runs, [c.metric for c in cols])
        table = results_table(
            scores, {c.metric: column_label(c, cols) for c in cols},
            labels=pd.Series(list(labels), index=scores.index),
            references=references, baseline=args.baseline, highlight=args.highlight,
            spread=args.spread, scale=args.scale, decimals=args.decimals, caption=args.caption,
            marking=args.marks)
        notes.extend(table.notes)
        written = write_table_files(table, out, title=args.caption or "Results")
        files.extend(written.values())
        summary["table"] = {k: str(v) for k, v in written.items()}
        summary["markdown"] = table.to_markdown()

    method_runs = runs[~runs["run_id"].isin(ref_ids)]
    per_run = _figures(client, method_runs, labels[method_runs.index], seeds, out, args, notes)
    files.extend(per_run.pop("_files"))
    if args.token_records:
        files.extend(_token_outputs(client, method_runs, labels[method_runs.index], out, args,
                                    notes))

    sources = pd.DataFrame({
        "run_id": runs["run_id"], "run_name": runs["run_name"],
        "experiment": runs["experiment"], "label": list(labels),
        "seed": list(seeds), "status": runs["status"],
        "reference": runs["run_id"].isin(ref_ids)})
    sources_path = out / "sources.csv"
    sources.to_csv(sources_path, index=False)
    files.append(sources_path)

    if args.log_to != "none":
        from saopd.analysis.reporting import log_files_to_run, log_report_run

        tags = {"saopd.report.query": query.describe()[:5000],
                "saopd.report.runs": str(len(runs))}
        summary["report_run_id"] = log_report_run(
            client, files, experiment=args.report_experiment,
            run_name=f"report-{out.name}", tags=tags)
        if args.log_to == "runs":
            for run_id, paths in per_run.items():
                log_files_to_run(client, run_id, paths)
    summary["files"] = [str(f) for f in files]
    (out / "report.json").write_text(json.dumps(
        {k: v for k, v in summary.items() if k != "markdown"}, indent=2) + "\n")
    return summary


def _figures(client: Any, runs: Any, labels: Any, seeds: Any, out: Path,
             args: argparse.Namespace, notes: list[str]) -> dict[str, Any]:
    """Training dynamics (all runs, and one per run) and entropy over steps, when logged."""
    from saopd.analysis.collect import metric_histories
    from saopd.analysis.plots import (
        ENTROPY_METRICS,
        FLMR_METRIC,
        LOSS_METRIC,
        entropy_over_steps_figure,
        save_figure,
        training_dynamics_figure,
    )

    produced: dict[str, Any] = {"_files": []}
    if runs.empty:
        return produced
    several = labels.duplicated(keep=False)
    names = {rid: (f"{lab} (seed {seeds[i]})" if several[i] else lab)
             for i, rid, lab in zip(runs.index, runs["run_id"], labels, strict=True)}
    groups = dict(zip(runs["run_id"], labels, strict=True))
    names = dict(sorted(names.items(), key=lambda kv: (list(dict.fromkeys(labels)).index(
        groups[kv[0]]), kv[1])))
    hist = metric_histories(client, runs["run_id"], (LOSS_METRIC, FLMR_METRIC, *ENTROPY_METRICS))
    have = set(hist["key"])
    if {LOSS_METRIC, FLMR_METRIC} <= have:
        fig = training_dynamics_figure(hist, names, groups=groups, smooth=args.smooth)
        produced["_files"].append(save_figure(fig, out / "training_dynamics.png"))
        if args.log_to == "runs":
            folder = out / "per_run"
            for rid in runs["run_id"]:
                h = hist[hist["run_id"] == rid]
                if {LOSS_METRIC, FLMR_METRIC} <= set(h["key"]):
                    path = save_figure(training_dynamics_figure(h, names, smooth=args.smooth),
                                       folder / f"training_dynamics_{rid[:8]}.png")
                    produced[rid] = [path]
    else:
        missing = sorted({LOSS_METRIC, FLMR_METRIC} - have)
        notes.append(f"training dynamics figure skipped: no selected run logged "
                     f"{', '.join(missing)}")
    _accuracy_figure(client, runs, groups, out, args, notes, produced)
    if set(ENTROPY_METRICS) <= have:
        fig = entropy_over_steps_figure(hist, names)
        produced["_files"].append(save_figure(fig, out / "entropy_over_steps.png"))
    else:
        notes.append(f"entropy-over-steps figure skipped: no run logged "
                     f"{' / '.join(ENTROPY_METRICS)}")
    return produced


def _accuracy_figure(client: Any, runs: Any, groups: dict[str, str], out: Path,
                     args: argparse.Namespace, notes: list[str],
                     produced: dict[str, Any]) -> None:
    """``accuracy_over_steps.png``: the held-out scores over steps, mean and 95% band per
    method (:func:`saopd.analysis.plots.over_steps_figure`)."""
    from saopd.analysis.collect import (
        NoRunsError,
        benchmark_columns,
        column_label,
        metric_histories,
    )
    from saopd.analysis.plots import over_steps_figure, save_figure

    wanted = [b.strip() for b in args.benchmarks.split(",") if b.strip()] \
        if args.benchmarks else None
    try:
        cols = benchmark_columns(runs, wanted)
    except NoRunsError:
        notes.append("accuracy-over-steps figure skipped: no selected run has an "
                     "eval/<benchmark>/avg_at_<k> metric")
        return
    hist = metric_histories(client, runs["run_id"], [c.metric for c in cols])
    panels = [(c.metric, f"held-out {column_label(c, cols)} (Avg@{c.k})") for c in cols]
    fig = over_steps_figure(hist, groups, panels, order=list(dict.fromkeys(groups.values())))
    produced["_files"].append(save_figure(fig, out / "accuracy_over_steps.png"))


def _token_outputs(client: Any, runs: Any, labels: Any, out: Path, args: argparse.Namespace,
                   notes: list[str]) -> list[Path]:
    """Table 4 and the entropy distribution per method, from the runs' token records."""
    import pandas as pd

    from saopd.analysis.collect import download_token_records
    from saopd.analysis.plots import entropy_distribution_figure, save_figure
    from saopd.analysis.reporting import slug
    from saopd.analysis.token_records import load_step_record
    from saopd.analysis.token_stats import render_token_statistics, token_frame, token_statistics

    frames: dict[str, list[Any]] = {}
    with tempfile.TemporaryDirectory(prefix="saopd-records-") as tmp:
        for rid, lab in zip(runs["run_id"], labels, strict=True):
            paths = download_token_records(client, rid, Path(tmp) / rid,
                                           last_only=not args.all_token_steps)
            if not paths:
                notes.append(f"run {rid} ({lab}) has no token_records/ artifacts")
                continue
            for path in paths:
                rec = load_step_record(path)
                frame = token_frame(rec.rows(), step=rec.step)
                frame.insert(0, "run_id", rid)
                frames.setdefault(lab, []).append(frame)
    files: list[Path] = []
    if not frames:
        raise ReportError("--token-records: none of the selected runs has token records "
                          "(training writes them every trainer.view_every_n_steps steps)")
    for lab, parts in frames.items():
        tokens = pd.concat(parts, ignore_index=True)
        if not tokens["filtered"].any():
            notes.append(f"{lab}: no filtered token in its records: no token statistics")
            continue
        stats = token_statistics(tokens)
        for fmt, ext in (("markdown", "md"), ("latex", "tex"), ("html", "html")):
            path = out / f"token_statistics_{slug(lab)}.{ext}"
            path.write_text(render_token_statistics(
                stats, fmt, caption=f"Token-level statistics of {lab}'s filtered tokens"),
                encoding="utf-8")
            files.append(path)
        if tokens["entropy_student"].notna().any():
            files.append(save_figure(entropy_distribution_figure(tokens, title=lab),
                                     out / f"entropy_{slug(lab)}.png"))
        else:
            notes.append(f"{lab}: token records carry no student entropy: no entropy "
                         "distribution figure")
    return files


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point (``saopd-report``); exit status 2 on bad input."""
    args = build_parser().parse_args(argv)
    try:
        summary = run_report(args)
    except ValueError as err:  # ReportError, and bad values met by the analysis functions
        print(f"saopd-report: error: {err}", file=sys.stderr)
        sys.exit(2)
    if "markdown" in summary:
        print(summary["markdown"])
    for note in summary["notes"]:
        print(f"note: {note}", file=sys.stderr)
    print(f"saopd-report: {summary['runs']} run(s) -> {summary['output_dir']}")
    for f in summary["files"]:
        print(f"  {f}")
    if "report_run_id" in summary:
        print(f"  MLflow report run: {summary['report_run_id']} "
              f"(experiment {args.report_experiment!r}, {summary['tracking_uri']})")


if __name__ == "__main__":
    main()
