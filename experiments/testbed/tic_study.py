"""The tic study end to end (``make testbed-tic``): models, 17 arms x 8 seeds, tables, figure.

The design, the arms, the checks and the predictions are in
``experiments/testbed/tic/PREREGISTRATION.md`` (committed before any run of a method).

1. ``dvc repro`` of the tic testbed's stages (nothing to do on a fresh clone: in git);
2. reference rows: the untrained student and the clean base teacher, evaluated as the runs are
   (Avg@4 on the 200 held-out problems, two sampling seeds); the teacher with the prior is the
   clean teacher's samples under (*) of :mod:`saopd.testbeds.tic`: in expectation its accuracy
   is (1 - r) x the clean teacher's and its tic rate r x its share of answers with an answer line;
3. the study's three sweeps as a user runs them: ``saopd-train -m experiment=testbed_tic
   study=tic_control|tic|tic_calibrated`` (MLflow, tagged ``study=...``; two runs at a time);
4. ``saopd-report`` per sweep, then this script's tables from MLflow and the run folders: final
   accuracy, tic rate, the accuracy of the answers without the tic, filtered share, FLMR; each
   arm's paired difference to OPD(prior), its share of the harm and of the slot oracle's
   recovery with Fieller's 95% intervals; what each filter removed by ground-truth source; the
   accuracy and tic rate over steps (mean and 95% band over seeds). All into
   ``experiments/testbed/results/tic/`` (``results.json`` holds every run's numbers).

    .venv/bin/python experiments/testbed/tic_study.py               # everything (~90 min)
    .venv/bin/python experiments/testbed/tic_study.py --skip-train  # tables only, from MLflow
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from saopd.analysis.tables import fieller_ratio_ci95, mean_ci95

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
OUT = REPO / "experiments" / "testbed" / "results" / "tic"
TASK = REPO / "data" / "prepared" / "testbed_tic" / "task.json"
EXPERIMENT = "testbed_tic"
EXPERIMENT_YAML = REPO / "conf" / "experiment" / "testbed_tic.yaml"
BENCH = "arith_tic"
K = 4
ACCURACY = f"eval/{BENCH}/avg_at_{K}"
TIC_RATE = f"eval/{BENCH}/phrase_tic"
PREAMBLE = f"eval/{BENCH}/phrase_preamble"
#: The tic's rate in the prior teacher (conf/model/testbed_tic_teacher_prior.yaml).
RATE = 0.3
#: The study's sweeps, in run order.
STUDIES = ("tic_control", "tic", "tic_calibrated")
STAGES = ["testbed_tic_data", "testbed_tic_teacher", "testbed_tic_student"]
CONTROL, PRIOR = "OPD (clean teacher)", "OPD (prior teacher)"
SLOT_ORACLE, TIC_ORACLE = "Oracle: tic slot", "Oracle: tic tokens"
#: Row labels by (study, method tag), in table order.
LABELS: dict[tuple[str, str], str] = {
    ("tic_control", "OPD"): CONTROL,
    ("tic", "OPD"): PRIOR,
    ("tic", SLOT_ORACLE): SLOT_ORACLE,
    ("tic", TIC_ORACLE): TIC_ORACLE,
    ("tic", "SA-OPD"): "SA-OPD (0.2, 0.3)",
    ("tic_calibrated", "SA-OPD"): "SA-OPD (0.8, 0.3)",
    ("tic", "SA-OPD (divergent ranks)"): "SA-OPD (divergent ranks)",
    ("tic", "SA-OPD (FLMR >= 5%)"): "SA-OPD (FLMR >= 5%)",
    ("tic_calibrated", "Random Filter"): "Random (at SA-OPD 0.8, 0.3's count)",
    ("tic_calibrated", "Divergence-only Filter"): "Divergence-only (same count)",
    ("tic_calibrated", "Input-Groundedness-only Filter"): "IG-only (same count)",
    ("tic_calibrated", "Proxy Replacement"): "Proxy replacement (same count)",
    ("tic", "TIP"): "TIP",
    ("tic", "FiRe-OPD"): "FiRe-OPD",
    ("tic", "ExOPD"): "ExOPD",
    ("tic", "TA-OPD"): "TA-OPD",
    ("tic", "Entropy-Aware OPD"): "Entropy-Aware OPD",
}


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
    subprocess.run(cmd, cwd=REPO, env=env, check=True)


def _fmt(mean: float, half: float, digits: int = 3) -> str:
    if math.isnan(mean):
        return "-"
    return f"{mean:.{digits}f}" if math.isnan(half) else f"{mean:.{digits}f} ± {half:.{digits}f}"


def _ratio(r: tuple[float, float, float]) -> str:
    ratio, low, high = r
    if math.isnan(ratio):
        return "-"
    if math.isinf(low) or math.isinf(high):
        return f"{ratio:.2f} (unbounded)"
    return f"{ratio:.2f} [{low:.2f}, {high:.2f}]"


def tic_split(samples: list[dict[str, Any]], tic: str) -> dict[str, float]:
    """The share of an evaluation's samples that wrote the tic, and the accuracy of the rest."""
    with_tic = [s for s in samples if tic in str(s["response"])]
    rest = [s for s in samples if tic not in str(s["response"])]
    return {"tic_share": len(with_tic) / max(len(samples), 1),
            "acc_without_tic": (sum(float(s["score"]) for s in rest) / len(rest)
                                if rest else float("nan"))}


def references(seeds: list[int]) -> dict[str, dict[str, list[float]]]:
    """The untrained student and the clean teacher evaluated as the runs are; the prior teacher
    from the clean teacher's samples under (*) (module docstring), in expectation."""
    import torch

    from saopd.config.rollout import HFRolloutConfig
    from saopd.eval.runner import evaluate_benchmark, load_benchmark
    from saopd.models.loading import load_causal_lm, load_tokenizer
    from saopd.rollout.base import SamplingParams
    from saopd.rollout.registry import build_engine
    from saopd.testbeds.arithmetic import load_tic

    torch.set_num_threads(1)
    tic = load_tic(TASK)
    assert tic is not None
    ev = dict(yaml.safe_load(EXPERIMENT_YAML.read_text(encoding="utf-8"))["eval"])
    problems = load_benchmark(BENCH, REPO / "data" / "prepared" / "eval", limit=200)
    out: dict[str, dict[str, list[float]]] = {}
    for label, folder in (("Student (untrained)", "student"), ("Clean teacher", "teacher")):
        path = REPO / "data" / "models" / "testbed_tic" / folder
        model, tok = load_causal_lm(str(path), dtype="float32"), load_tokenizer(str(path))
        engine = build_engine(HFRolloutConfig(batch_size=64), model.eval(), tok)
        rows: dict[str, list[float]] = {}
        prior: dict[str, list[float]] = {}
        for seed in seeds:
            res = evaluate_benchmark(BENCH, problems, engine, tok, SamplingParams(
                n=K, temperature=1.0, top_p=1.0, max_new_tokens=int(ev["max_new_tokens"]),
                seed=seed), batch_size=64)
            vals = {"accuracy": res.score, "tic": res.extra.get("phrase_tic", math.nan),
                    "preamble": res.extra.get("phrase_preamble", math.nan),
                    **tic_split(res.samples, tic)}
            for key, value in vals.items():
                rows.setdefault(key, []).append(value)
            if folder == "teacher":
                slot = sum("\\boxed{" in str(s["response"]) for s in res.samples) \
                    / max(len(res.samples), 1)
                for key, value in {"accuracy": (1 - RATE) * res.score, "tic": RATE * slot,
                                   "preamble": vals["preamble"], "tic_share": RATE * slot,
                                   "acc_without_tic": vals["acc_without_tic"]}.items():
                    prior.setdefault(key, []).append(value)
        out[label] = rows
        if prior:
            out["Teacher with the prior (expected under (*))"] = prior
    for label, rows in out.items():
        print(label, {k: _fmt(*mean_ci95(v)) for k, v in rows.items()}, flush=True)
    return out


def collect() -> tuple[Any, dict[str, dict[str, Any]], Any]:
    """The study's finished runs (label, seed, run id), each run's numbers, and the metric
    histories of accuracy and tic rate."""
    import pandas as pd

    from saopd.analysis.collect import (
        RunQuery,
        load_runs,
        metric_histories,
        mlflow_client,
        run_seeds,
    )
    from saopd.filters.oracle import tic_token_ids
    from saopd.models.tiny import tiny_tokenizer
    from saopd.testbeds.arithmetic import (
        TicTruth,
        load_habits,
        load_tic,
        read_token_records,
        selection_by_source,
    )

    uri = f"sqlite:///{REPO / 'mlflow.db'}"
    parts = []
    for study in STUDIES:
        found = load_runs(uri, RunQuery(experiments=(EXPERIMENT,), tags={"study": study},
                                        statuses=("FINISHED",)))
        methods = found["tags.method"] if "tags.method" in found else pd.Series(dtype=str)
        labels = [LABELS.get((study, str(m)), f"{m} ({study})") for m in methods]
        parts.append(found.assign(label=labels, seed=run_seeds(found), study=study))
    runs = pd.concat(parts, ignore_index=True)
    runs = runs.sort_values("start_time").drop_duplicates(["label", "seed"], keep="last")
    order = {lab: i for i, lab in enumerate(LABELS.values())}
    runs = runs.assign(order=runs.label.map(lambda x: order.get(x, len(order))))
    runs = runs.sort_values(["order", "seed"], kind="stable")
    text = load_tic(TASK)
    assert text is not None
    end, ids = tic_token_ids(tiny_tokenizer(), text, "}.")
    truth, habits = TicTruth(end, tuple(ids)), load_habits(TASK)
    keys = [ACCURACY, TIC_RATE, PREAMBLE, "train/filtered_ratio", "train/flmr"]
    hist = metric_histories(uri, runs["run_id"], keys)
    client = mlflow_client(uri)
    per_run: dict[str, dict[str, Any]] = {}
    for run_id in runs["run_id"]:
        h = hist[hist.run_id == run_id]
        row: dict[str, Any] = {}
        for key in keys:
            pts = h[h.key == key].sort_values("step")
            agg = pts.value.iloc[-1] if key.startswith("eval/") else pts.value.mean()
            row[key] = float(agg) if len(pts) else math.nan
        tags = client.get_run(run_id).data.tags
        folder = Path(tags["sweep"]) / tags["sweep_job"] if "sweep" in tags else None
        evals = sorted(folder.glob("eval/step_*/arith_tic.jsonl")) if folder else []
        if evals:
            samples = [json.loads(x) for x in evals[-1].read_text().splitlines() if x.strip()]
            row.update(tic_split(samples, text))
        records = read_token_records(folder / "token_records") if folder else []
        counts = selection_by_source((x for r in records for x in r["responses"]), habits,
                                     tic=truth)
        row.update({f"sel/{k}": v for k, v in counts.summary().items()})
        slot_v = counts.valid["tic"] + counts.valid["tic_slot"]
        row["sel/p_filtered_slot_all"] = ((counts.filtered["tic"] + counts.filtered["tic_slot"])
                                          / slot_v if slot_v else math.nan)
        per_run[run_id] = row
    return runs, per_run, hist


def analyse(refs: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    runs, per_run, hist = collect()
    labels = list(dict.fromkeys(runs["label"]))
    by = {lab: {int(s): per_run[r] for r, s in zip(runs[runs.label == lab]["run_id"],
                                                   runs[runs.label == lab]["seed"], strict=True)}
          for lab in labels}

    def col(lab: str, key: str) -> list[float]:
        return [float(v.get(key, math.nan)) for v in by[lab].values()]

    lines = ["# The tic study: results", "",
             "Generated by `experiments/testbed/tic_study.py` from MLflow and the run folders. "
             "Final evaluation = Avg@4 on the 200 held-out problems after the last step; "
             "filtered share and FLMR: means over the steps; mean ± 95% CI over seeds "
             "(reference rows: over 2 sampling seeds).", "",
             "## Held-out accuracy and the tic (final evaluation)", "",
             "| arm | seeds | accuracy | tic rate | accuracy without the tic | preamble | "
             "filtered share | FLMR |", "|---" * 8 + "|"]
    for lab, rows in refs.items():
        lines.append(f"| {lab} | {len(rows['accuracy'])} sampling seeds | "
                     + " | ".join(_fmt(*mean_ci95(rows[k])) for k in
                                  ("accuracy", "tic", "acc_without_tic", "preamble"))
                     + " | - | - |")
    table: dict[str, dict[str, list[float]]] = {}
    for lab in labels:
        cells = {k: mean_ci95(col(lab, key)) for k, key in (
            ("accuracy", ACCURACY), ("tic", TIC_RATE), ("acc_without_tic", "acc_without_tic"),
            ("preamble", PREAMBLE), ("filtered", "train/filtered_ratio"),
            ("flmr", "train/flmr"))}
        table[lab] = {k: list(v) for k, v in cells.items()}
        lines.append(f"| {lab} | {len(by[lab])} | "
                     + " | ".join(_fmt(*v) for v in cells.values()) + " |")
    harm: dict[str, Any] = {}
    if CONTROL in by and PRIOR in by:
        seeds = sorted(set(by[CONTROL]) & set(by[PRIOR]))
        h = [by[CONTROL][s][ACCURACY] - by[PRIOR][s][ACCURACY] for s in seeds]
        oracle = by.get(SLOT_ORACLE, {})
        lines += ["", f"## Against OPD from the prior teacher (paired over seeds; the harm "
                  f"OPD(clean) - OPD(prior) = {_fmt(*mean_ci95(h))}, {len(seeds)} seeds)", "",
                  "| arm | paired seeds | accuracy - OPD(prior) | share of the harm recovered "
                  "[Fieller 95%] | share of the slot oracle's recovery [Fieller 95%] |",
                  "|---|---|---|---|---|"]
        for lab in labels:
            common = [s for s in seeds if s in by[lab]]
            d = [by[lab][s][ACCURACY] - by[PRIOR][s][ACCURACY] for s in common]
            hh = [by[CONTROL][s][ACCURACY] - by[PRIOR][s][ACCURACY] for s in common]
            o_seeds = [s for s in common if s in oracle]
            share = fieller_ratio_ci95(d, hh)
            of_oracle = fieller_ratio_ci95(
                [by[lab][s][ACCURACY] - by[PRIOR][s][ACCURACY] for s in o_seeds],
                [oracle[s][ACCURACY] - by[PRIOR][s][ACCURACY] for s in o_seeds])
            harm[lab] = {"seeds": common, "diff": list(mean_ci95(d)), "share": list(share),
                         "share_of_oracle": list(of_oracle)}
            lines.append(f"| {lab} | {len(common)} | {_fmt(*mean_ci95(d))} | {_ratio(share)} | "
                         f"{_ratio(of_oracle)} |")
        harm["harm"] = {"seeds": seeds, "values": h, "mean_ci95": list(mean_ci95(h))}
    lines += ["", "## What each filter removed, by ground-truth source (every 5th step's token "
              "records; mean ± 95% CI over seeds)", "",
              "| arm | filtered share | P(filtered \\| tic) | P(filtered \\| rest of the slot) | "
              "P(filtered \\| tic slot, all) | P(filtered \\| grounded) | \\|A\\| tic | "
              "\\|A\\| rest of slot | \\|A\\| grounded | gap tic | gap rest of slot | "
              "gap grounded |", "|---" * 12 + "|"]
    sel_keys = ["filtered_share", "p_filtered_tic", "p_filtered_tic_slot", "p_filtered_slot_all",
                "p_filtered_grounded", "abs_a_tic", "abs_a_tic_slot", "abs_a_grounded", "gap_tic",
                "gap_tic_slot", "gap_grounded"]
    for lab in labels:
        lines.append(f"| {lab} | " + " | ".join(_fmt(*mean_ci95(col(lab, f"sel/{k}")))
                                                 for k in sel_keys) + " |")
    (OUT / "results.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines), flush=True)
    _figure(runs, hist, labels)
    return {"methods": table, "harm": harm, "references": refs,
            "runs": {r: {"label": lab, "seed": int(seed), **per_run[r]}
                     for r, lab, seed in zip(runs["run_id"], runs["label"], runs["seed"],
                                             strict=True)}}


def _figure(runs: Any, hist: Any, labels: list[str]) -> None:
    """Accuracy and tic rate over steps: mean and 95% band over seeds, one line per arm
    (saopd-report's figure, :func:`saopd.analysis.plots.over_steps_figure`)."""
    from saopd.analysis.plots import over_steps_figure, save_figure

    groups = dict(zip(runs["run_id"], runs["label"], strict=True))
    fig = over_steps_figure(hist, groups, [(ACCURACY, "held-out accuracy (Avg@4)"),
                                           (TIC_RATE, "tic rate")], order=labels)
    save_figure(fig, OUT / "over_steps.png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-train", action="store_true", help="only the tables, from MLflow")
    ap.add_argument("--studies", default=",".join(STUDIES))
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel (joblib launcher)")
    ap.add_argument("--ref-seeds", default="0,1")
    ap.add_argument("--overrides", nargs="*", default=[],
                    help="extra saopd-train overrides for every sweep (e.g. seed=0,1 for a "
                         "partial study; its runs join the store's tables)")
    args = ap.parse_args(argv)
    unknown = [s for s in args.studies.split(",") if s not in STUDIES]
    if unknown:
        ap.error(f"unknown studies {unknown}; known: {list(STUDIES)}")
    OUT.mkdir(parents=True, exist_ok=True)
    _run([str(BIN / "dvc"), "repro", *STAGES])
    refs = references([int(s) for s in args.ref_seeds.split(",")])
    # parallel jobs: no progress lines (they would interleave in this one console)
    launcher = [] if args.jobs <= 1 else ["hydra/launcher=joblib",
                                          f"hydra.launcher.n_jobs={args.jobs}",
                                          "trainer.progress_bar=false"]
    for study in args.studies.split(","):
        if not args.skip_train:
            _run([str(BIN / "saopd-train"), "-m", f"experiment={EXPERIMENT}", f"study={study}",
                  *launcher, *args.overrides])
        _run([str(BIN / "saopd-report"), "-e", EXPERIMENT, "-t", f"study={study}",
              "--spread", "ci95", "--benchmarks", BENCH, "--out", str(OUT / f"report_{study}"),
              "--log-to", "none"])
    results = analyse(refs)
    (OUT / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
