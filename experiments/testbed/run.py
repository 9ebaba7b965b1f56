"""The arithmetic testbed end to end: models, studies, tables and figures (``make testbed``).

1. ``dvc repro`` of the testbed's stages (data, the prior teacher, its clean control and the
   student; nothing to do on a fresh clone: their outputs are in git);
2. reference rows: the untrained student and both teachers on the held-out benchmark ``arith``
   (the same evaluation as during training, one sampling seed per study seed);
3. each study as a user runs it: ``saopd-train -m experiment=testbed study=<study>`` (MLflow,
   tagged ``study=<study>``; ``--jobs`` runs in parallel through Hydra's joblib launcher, one
   torch thread each), the student evaluated before the first step and every 25 steps. The
   studies (:data:`SWEEPS`): ``teacher_control`` is vanilla OPD from the clean teacher (the
   control: OPD(clean)); ``baselines`` runs every method from the prior teacher: OPD (OPD(prior)),
   SA-OPD as the paper configures it, saopd's divergent-ranks variant (not the paper's), SA-OPD
   with Algorithm 2's FLMR floor, and the baselines; ``ablation_filters`` runs Table 3's four
   ablations calibrated to the divergent-ranks SA-OPD's share per batch; ``p1p2_grid`` trains
   the paper's SA-OPD at its p1 x p2 grid; tables borrow rows from other studies' runs (the same
   runs, not re-run);
4. per study: ``saopd-report`` (accuracy, mean ± 95% CI) and this script's own tables: accuracy,
   the shortcut's rate and the accuracy on each side of it, habit rates, filtered share, FLMR,
   each method's paired difference to OPD(prior) over the same seeds and the share of the harm
   OPD(clean) - OPD(prior) it recovers, and the filter's selection by ground-truth source
   (:mod:`saopd.testbeds.arithmetic`, from each run's token records), plus figures over steps;
   all into ``experiments/testbed/results/`` (``results.json`` holds every seed's numbers).

    .venv/bin/python experiments/testbed/run.py                      # everything
    .venv/bin/python experiments/testbed/run.py --studies baselines --skip-train   # tables only
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

from saopd.analysis.tables import mean_ci95

REPO = Path(__file__).resolve().parents[2]
BIN = REPO / ".venv" / "bin"
OUT = REPO / "experiments" / "testbed" / "results"
TASK = REPO / "data" / "prepared" / "testbed" / "task.json"
EXPERIMENT = "testbed"
EXPERIMENT_YAML = REPO / "conf" / "experiment" / "testbed.yaml"
#: The experiment's ``eval`` section (k, sampling, length, every_n_steps): the runs' evaluations,
#: which the reference rows repeat.
EVAL: dict[str, Any] = dict(yaml.safe_load(EXPERIMENT_YAML.read_text(encoding="utf-8"))["eval"])
#: The accuracy metric of the runs' evaluations (Avg@k, the experiment's eval.k).
ACCURACY = f"eval/arith/avg_at_{EVAL['k']}"
#: The shortcut's metrics (the harmful prior): its rate in the student's samples and the
#: accuracy of the samples that took it and of those that did not; the same keys of the
#: reference rows.
SHORTCUT_KEYS = ["eval/arith/shortcut", "eval/arith/acc_shortcut", "eval/arith/acc_worked"]
REF_SHORTCUT = ["shortcut", "acc_shortcut", "acc_worked"]
#: (p1, p2) at which SA-OPD's rule is re-applied to the SA-OPD runs' token records: the paper's
#: ratios, the paper's p1/p2 grid corners, and wider p1 (what it takes to reach past the tokens
#: both models are certain of).
RATIOS = [(0.2, 0.3), (0.1, 0.2), (0.3, 0.4), (0.5, 0.1), (0.5, 0.3), (0.8, 0.1), (0.8, 0.3)]
#: The seeds of every study (each method row has this many runs) but those in STUDY_SEEDS.
SEEDS = "0,1,2,3,4"
#: Studies run at fewer seeds: the p1 x p2 grid (nine cells) at three.
STUDY_SEEDS = {"p1p2_grid": "0,1,2"}
#: The label of the control's runs (vanilla OPD from the clean teacher) and of OPD from the prior
#: teacher: the harm is the difference of the two.
CONTROL, OPD_PRIOR = "OPD (clean teacher)", "OPD"
#: The sweep of each study: its saopd-train overrides, and the rows its tables borrow from
#: another study's runs (label -> study).
SWEEPS: dict[str, tuple[list[str], dict[str, str]]] = {
    "teacher_control": (["method=opd", "model@teacher=testbed_teacher"], {}),
    "baselines": (["method=opd,sa_opd,sa_opd_divergent,sa_opd_floor,exopd,tip,fire_opd,"
                   "teachability,entropy_aware"], {CONTROL: "teacher_control"}),
    "ablation_filters": (["method=random,divergence_only,ig_only,proxy_replacement",
                          "filter.rank_over=divergent"],
                         {CONTROL: "teacher_control", OPD_PRIOR: "baselines",
                          "SA-OPD (divergent ranks)": "baselines"}),
    "p1p2_grid": (["method=sa_opd", "filter.p1=0.1,0.2,0.3", "filter.p2=0.2,0.3,0.4"],
                  {CONTROL: "teacher_control", OPD_PRIOR: "baselines"}),
}
#: The testbed's DVC stages (step 1).
STAGES = ["testbed_data", "testbed_teacher", "testbed_teacher_prior", "testbed_student"]


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
    subprocess.run(cmd, cwd=REPO, env=env, check=True)


def _fmt(mean: float, half: float, digits: int = 3) -> str:
    if math.isnan(mean):
        return "-"
    return f"{mean:.{digits}f}" if math.isnan(half) else f"{mean:.{digits}f} ± {half:.{digits}f}"


def solution_shares(samples: list[dict[str, Any]]) -> dict[str, float]:
    """The share of ``samples`` (an evaluation's per-sample rows) of each kind of worked solution
    (:func:`saopd.stages.testbed.classify_solution`: exact column lines, a wrong line, too few or
    too many lines, the shortcut), keyed ``sol/<kind>``."""
    from saopd.stages.testbed import SOLUTION_KINDS, Problem, classify_solution

    counts = dict.fromkeys(SOLUTION_KINDS, 0)
    for row in samples:  # ids are "arith-test-<a>+<b>"
        a, b = (int(x) for x in str(row["id"]).rsplit("-", 1)[1].split("+"))
        counts[classify_solution(str(row["response"]), Problem(a, b))] += 1
    return {f"sol/{k}": v / max(len(samples), 1) for k, v in counts.items()}


def final_eval_samples(client: Any, run_id: str) -> list[dict[str, Any]] | None:
    """The per-sample rows of a run's last evaluation, read from its run folder (the sweep's
    ``sweep``/``sweep_job`` tags; ``client``: an ``MlflowClient``); None when the folder is not
    on this machine."""
    tags = client.get_run(run_id).data.tags
    if "sweep" not in tags or "sweep_job" not in tags:
        return None
    evals = sorted((Path(tags["sweep"]) / tags["sweep_job"] / "eval").glob("step_*/arith.jsonl"))
    if not evals:
        return None
    with evals[-1].open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def references(seeds: list[int], limit: int) -> dict[str, dict[str, list[float]]]:
    """Held-out accuracy and habit rates of the untrained student and of the teacher, sampled
    as the runs' evaluations sample (the experiment's k, temperature, top-p and length), one
    sampling seed per study seed."""
    import torch

    from saopd.config.rollout import HFRolloutConfig
    from saopd.eval.runner import evaluate_benchmark, load_benchmark
    from saopd.models.loading import load_causal_lm, load_tokenizer
    from saopd.rollout.base import SamplingParams
    from saopd.rollout.registry import build_engine

    torch.set_num_threads(1)
    problems = load_benchmark("arith", REPO / "data" / "prepared" / "eval", limit=limit)
    out: dict[str, dict[str, list[float]]] = {}
    for label, folder in (("Student (untrained)", "student"),
                          ("Teacher with the prior", "teacher_prior"),
                          ("Clean teacher", "teacher")):
        path = REPO / "data" / "models" / "testbed" / folder
        model, tok = load_causal_lm(str(path), dtype="float32"), load_tokenizer(str(path))
        engine = build_engine(HFRolloutConfig(batch_size=64), model.eval(), tok)
        rows: dict[str, list[float]] = {}
        for seed in seeds:
            res = evaluate_benchmark("arith", problems, engine, tok,
                                     SamplingParams(n=int(EVAL["k"]),
                                                    temperature=float(EVAL["temperature"]),
                                                    top_p=float(EVAL["top_p"]),
                                                    max_new_tokens=int(EVAL["max_new_tokens"]),
                                                    seed=seed), batch_size=64)
            for key, value in {"accuracy": res.score, **res.extra,
                               **solution_shares(res.samples)}.items():
                rows.setdefault(key, []).append(value)
        out[label] = rows
        print(label, {k: _fmt(*mean_ci95(v)) for k, v in rows.items()}, flush=True)
    return out


def analyse(study: str, refs: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Per-method tables (mean ± 95% CI over seeds) and figures of one study's runs."""
    import pandas as pd

    from saopd.analysis.collect import (
        RunQuery,
        download_token_records,
        load_runs,
        method_labels,
        metric_histories,
        mlflow_client,
        run_seeds,
    )
    from saopd.testbeds.arithmetic import (
        SourceCounts,
        load_habits,
        load_shortcut,
        read_token_records,
        selection_at_ratios,
        selection_by_source,
    )

    uri = f"sqlite:///{REPO / 'mlflow.db'}"

    def study_runs(name: str) -> Any:
        found = load_runs(uri, RunQuery(experiments=(EXPERIMENT,), tags={"study": name},
                                        statuses=("FINISHED",)))
        if name == "teacher_control":
            labels = CONTROL
        elif name == "p1p2_grid":  # one label per cell: the method tag is SA-OPD for all nine
            labels = method_labels(found, label_tag=None)
        else:
            labels = method_labels(found)
        return found.assign(label=labels, seed=run_seeds(found))

    borrowed = SWEEPS[study][1]
    parts = [study_runs(study)]
    for other in sorted(set(borrowed.values())):
        theirs = study_runs(other)
        parts.append(theirs[theirs.label.isin([k for k, v in borrowed.items() if v == other])])
    runs = pd.concat(parts, ignore_index=True)
    runs = runs.sort_values("start_time").drop_duplicates(["label", "seed"], keep="last")
    order = [*borrowed, *dict.fromkeys(parts[0].sort_values("start_time").label)]
    runs = runs.assign(order=runs.label.map({lab: i for i, lab in enumerate(order)}))
    runs = runs.sort_values(["order", "seed"], kind="stable")
    habits, shortcut = load_habits(TASK), load_shortcut(TASK)
    phrase_keys = [f"eval/arith/phrase_{h.name}" for h in habits]
    keys = [ACCURACY, *SHORTCUT_KEYS, *phrase_keys, "train/filtered_ratio", "train/flmr"]
    hist = metric_histories(uri, runs["run_id"], keys)
    client = mlflow_client(uri)  # one client for every run's tags and token records
    per_run: dict[str, dict[str, float]] = {}
    what_if = {ratio: SourceCounts() for ratio in RATIOS}
    sa_opd_ids = set(runs[runs.label == "SA-OPD"]["run_id"])
    for run_id in runs["run_id"]:
        h = hist[hist.run_id == run_id]
        row: dict[str, float] = {}
        for key in keys:
            pts = h[h.key == key].sort_values("step")
            if key.startswith("eval/"):
                row[key] = float(pts.value.iloc[-1]) if len(pts) else float("nan")
            else:  # training metrics: the mean over the run's steps
                row[key] = float(pts.value.mean()) if len(pts) else float("nan")
        samples = final_eval_samples(client, run_id)
        if samples is None:
            print(f"run {run_id}: its run folder is not here; no solution kinds", flush=True)
        row.update(solution_shares(samples) if samples is not None else {})
        files = download_token_records(client, run_id, OUT / ".records" / run_id)
        records = read_token_records(files[0].parent) if files else []
        counts = selection_by_source((x for r in records for x in r["responses"]), habits,
                                     shortcut)
        row.update({f"sel/{k}": v for k, v in counts.summary().items()})
        per_run[run_id] = row
        if run_id in sa_opd_ids:  # the paper's SA-OPD: what its rule would do at other ratios
            for ratio, c in selection_at_ratios(records, habits, RATIOS,
                                                shortcut=shortcut).items():
                what_if[ratio].add(c)
    methods = list(dict.fromkeys(runs["label"]))
    table: dict[str, dict[str, tuple[float, float]]] = {}
    for label in methods:
        ids = runs[runs.label == label]["run_id"]
        cols = per_run[ids.iloc[0]].keys()
        table[label] = {c: mean_ci95([per_run[i].get(c, math.nan) for i in ids]) for c in cols}
    harm = harm_table(runs, per_run)
    _write_tables(study, table, refs, habits, n_seeds=runs.groupby("label").size().to_dict(),
                  what_if={r: c.summary() for r, c in what_if.items() if sa_opd_ids}, harm=harm)
    _figures(study, runs, hist, [*SHORTCUT_KEYS[:1], *phrase_keys])
    return {"methods": {m: {c: list(v) for c, v in cols.items()} for m, cols in table.items()},
            "harm": harm,
            "runs": {r: {"label": lab, "seed": seed, **per_run[r]}
                     for r, lab, seed in zip(runs["run_id"], runs["label"], runs["seed"],
                                             strict=True)}}


def harm_table(runs: Any, per_run: dict[str, dict[str, float]]) -> dict[str, dict[str, Any]]:
    """Per method: the paired difference of final accuracy to OPD(prior) over the seeds both ran
    and the share of the harm OPD(clean) - OPD(prior) it recovers
    (:func:`saopd.analysis.tables.paired_recovery`); empty without OPD(prior) runs."""
    from saopd.analysis.tables import paired_recovery

    scores = {label: {str(s): per_run[r][ACCURACY]
                      for r, s in zip(sub["run_id"], sub["seed"], strict=True)}
              for label, sub in runs.groupby("label", sort=False)}
    if OPD_PRIOR not in scores:
        return {}
    return paired_recovery(scores, base=OPD_PRIOR, control=CONTROL)


def _write_tables(study: str, table: dict[str, dict[str, tuple[float, float]]],
                  refs: dict[str, dict[str, list[float]]], habits: list[Any],
                  n_seeds: dict[str, int],
                  what_if: dict[tuple[float, float], dict[str, float]],
                  harm: dict[str, dict[str, Any]]) -> None:
    names = [h.name for h in habits]
    lines = [f"## {study}: held-out accuracy, the shortcut and the habits (final step; mean ± "
             "95% CI over seeds)", "",
             "| method | seeds | accuracy | shortcut rate | accuracy: shortcut | accuracy: worked "
             "| " + " | ".join(f"habit `{n}`" for n in names) + " | filtered share | FLMR |",
             "|---" * (8 + len(names)) + "|"]
    for label, vals in refs.items():
        cells = [_fmt(*mean_ci95(vals.get(k, []))) for k in ("accuracy", *REF_SHORTCUT)] + \
                [_fmt(*mean_ci95(vals[f"phrase_{n}"])) for n in names]
        lines.append(f"| {label} | {len(vals['accuracy'])} sampling seeds | " + " | ".join(cells)
                     + " | - | - |")
    for label, cols in table.items():
        cells = [_fmt(*cols[ACCURACY])] + [_fmt(*cols[k]) for k in SHORTCUT_KEYS] + \
                [_fmt(*cols[f"eval/arith/phrase_{n}"]) for n in names] + \
                [_fmt(*cols["train/filtered_ratio"]), _fmt(*cols["train/flmr"])]
        lines.append(f"| {label} | {n_seeds.get(label, 0)} | " + " | ".join(cells) + " |")
    if harm:
        h = next(iter(harm.values()))["harm"]
        lines += ["", f"## {study}: against OPD from the prior teacher (paired over seeds; the "
                  f"harm OPD(clean) - OPD(prior) = {_fmt(*h)})", "",
                  "| method | paired seeds | accuracy - OPD(prior) | share of the harm recovered "
                  "|", "|---" * 4 + "|"]
        for label, row in harm.items():
            lines.append(f"| {label} | {row['pairs']} | {_fmt(*row['diff'])} | "
                         f"{_fmt(*row['recovered'], digits=2)} |")
    lines += ["", f"## {study}: the filter's selection by ground-truth source (all steps' "
              "token records; mean ± 95% CI over seeds)", "",
              "| method | filtered share | P(filtered \\| shortcut) | P(filtered \\| habit onset) "
              "| P(filtered \\| habit) | P(filtered \\| slot) | P(filtered \\| grounded) | "
              "filtered from shortcut | from habit | from slot | from grounded | |A| shortcut | "
              "|A| grounded | gap shortcut | gap habit | gap slot | gap grounded |",
              "|---" * 17 + "|"]
    for label, cols in table.items():
        keys = ["sel/filtered_share", "sel/p_filtered_shortcut", "sel/p_filtered_habit_onset",
                "sel/p_filtered_habit", "sel/p_filtered_slot", "sel/p_filtered_grounded",
                "sel/filtered_from_shortcut", "sel/filtered_from_habit", "sel/filtered_from_slot",
                "sel/filtered_from_grounded", "sel/abs_a_shortcut", "sel/abs_a_grounded",
                "sel/gap_shortcut", "sel/gap_habit", "sel/gap_slot", "sel/gap_grounded"]
        lines.append(f"| {label} | " + " | ".join(_fmt(*cols[k]) for k in keys) + " |")
    from saopd.stages.testbed import SOLUTION_KINDS as kinds  # the table's column order

    lines += ["", f"## {study}: where the answers go wrong (the final evaluation's samples, "
              "against the exact column lines; share of samples; mean ± 95% CI over seeds)", "",
              "| method | column lines exact | a wrong line | too few lines | too many lines | "
              "shortcut (no line) |", "|---" * 6 + "|"]
    for label, vals in refs.items():
        lines.append(f"| {label} | " + " | ".join(
            _fmt(*mean_ci95(vals.get(f"sol/{k}", []))) for k in kinds) + " |")
    for label, cols in table.items():
        lines.append(f"| {label} | " + " | ".join(
            _fmt(*cols.get(f"sol/{k}", (math.nan, math.nan))) for k in kinds) + " |")
    if what_if:
        lines += ["", f"## {study}: what SA-OPD's rule (Eq. 16) would remove at other (p1, p2), "
                  "re-applied to the token records of the SA-OPD runs (all seeds pooled)", "",
                  "| p1 | p2 | filtered share | P(filtered \\| shortcut) | P(filtered \\| habit "
                  "onset) | P(filtered \\| habit) | P(filtered \\| slot) | P(filtered \\| "
                  "grounded) |", "|---" * 8 + "|"]
        for (p1, p2), sel in what_if.items():
            cells = [sel[k] for k in ("filtered_share", "p_filtered_shortcut",
                                      "p_filtered_habit_onset",
                                      "p_filtered_habit", "p_filtered_slot",
                                      "p_filtered_grounded")]
            lines.append(f"| {p1} | {p2} | " + " | ".join(f"{c:.4f}" for c in cells) + " |")
    (OUT / f"{study}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines), flush=True)


def _figures(study: str, runs: Any, hist: Any, phrase_keys: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [ACCURACY, *phrase_keys]
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6))
    for ax, key in zip(axes, keys, strict=True):
        for label in dict.fromkeys(runs["label"]):
            ids = set(runs[runs.label == label]["run_id"])
            h = hist[(hist.key == key) & hist.run_id.isin(ids)]
            mean = h.groupby("step").value.mean()
            ax.plot(mean.index + 1, mean.values, marker="o", label=label)
        ax.set_title(key.replace("eval/arith/", "").replace(ACCURACY.split("/")[-1],
                                                             "accuracy"))
        ax.set_xlabel("steps trained (0: before training)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / f"{study}_over_steps.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the testbed (see the module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--studies", default="teacher_control,baselines,ablation_filters,p1p2_grid")
    ap.add_argument("--seeds", default=None,
                    help=f"the seeds of every sweep (default: {SEEDS}; {STUDY_SEEDS})")
    ap.add_argument("--methods", default=None,
                    help="only these methods of a sweep that lists methods (comma-separated "
                         "conf/method names), e.g. to run a study in parts")
    ap.add_argument("--skip-train", action="store_true", help="only tables from MLflow runs")
    ap.add_argument("--eval-every", type=int, default=None,
                    help="evaluate every N steps (default: the experiment's eval.every_n_steps)")
    ap.add_argument("--jobs", type=int, default=2,
                    help="runs in parallel (Hydra's joblib launcher; 1 = one after another)")
    ap.add_argument("--overrides", nargs="*", default=[],
                    help="extra saopd-train overrides for every sweep, e.g. a quick end-to-end "
                         "check: --overrides steps=4 seed=0 --eval-every 2 (its runs join the "
                         "store's tables: use a scratch clone)")
    ap.add_argument("--ref-seeds", default=SEEDS)
    ap.add_argument("--ref-limit", type=int, default=200)
    args = ap.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    unknown = [s for s in args.studies.split(",") if s not in SWEEPS]
    if unknown:
        ap.error(f"unknown studies {unknown}; known: {list(SWEEPS)}")
    _run([str(BIN / "dvc"), "repro", *STAGES])
    refs = references([int(s) for s in args.ref_seeds.split(",")], args.ref_limit)
    # the studies not run this time keep their numbers: results.json holds every study's seeds
    saved = OUT / "results.json"
    results: dict[str, Any] = (json.loads(saved.read_text(encoding="utf-8"))
                               if saved.exists() else {})
    results["references"] = refs
    every = args.eval_every or int(EVAL["every_n_steps"])
    launcher = [] if args.jobs <= 1 else [  # no progress lines: they would interleave
        "hydra/launcher=joblib", f"hydra.launcher.n_jobs={args.jobs}",
        "trainer.progress_bar=false"]
    for study in args.studies.split(","):
        if not args.skip_train:
            sweep = list(SWEEPS[study][0])
            if args.methods:
                sweep = [f"method={args.methods}" if o.startswith("method=") else o
                         for o in sweep]
            _run([str(BIN / "saopd-train"), "-m", f"experiment={EXPERIMENT}", f"study={study}",
                  *sweep, f"seed={args.seeds or STUDY_SEEDS.get(study, SEEDS)}",
                  f"eval.every_n_steps={every}", *launcher,
                  *args.overrides])
        _run([str(BIN / "saopd-report"), "-e", EXPERIMENT, "-t", f"study={study}",
              "--spread", "ci95", "--benchmarks", "arith", "--out", str(OUT / f"report_{study}"),
              "--log-to", "none"])
        results[study] = analyse(study, refs)
        saved.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
