"""The first testbed study's positive control: the shortcut oracle, against its OPD rows.

Runs ``saopd-train -m experiment=testbed study=shortcut_oracle`` (``method=oracle_shortcut`` at
the study's seeds 0-4, the same 200 steps and final evaluation as every row of that study;
MLflow, tagged ``study=shortcut_oracle``), then pairs each seed's final held-out Avg@4 with OPD
from the prior teacher and from the clean teacher of the same seed, read from
``results/results.json`` (the study's runs are deterministic on one machine: re-runs gave the
same numbers to every digit).
Writes ``results/shortcut_oracle.md``: the oracle's accuracy and shortcut rate, its paired
difference to OPD(prior) and its share of the harm with Fieller's 95% interval.

    .venv/bin/python experiments/testbed/shortcut_oracle.py             # 5 runs, two at a time
    .venv/bin/python experiments/testbed/shortcut_oracle.py --skip-train  # the table again
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from saopd.analysis.tables import fieller_ratio_ci95, mean_ci95

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
OUT = REPO / "experiments" / "testbed" / "results"
ACC, SHORTCUT = "eval/arith/avg_at_4", "eval/arith/shortcut"
SEEDS = [0, 1, 2, 3, 4]


def study_rows(results: dict[str, Any], label: str) -> dict[int, dict[str, float]]:
    """``label``'s runs of the ``baselines`` study in results.json, by seed."""
    return {int(v["seed"]): v for v in results["baselines"]["runs"].values()
            if v["label"] == label}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-train", action="store_true")
    args = ap.parse_args(argv)
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
    if not args.skip_train:
        cmd = [str(BIN / "saopd-train"), "-m", "experiment=testbed", "study=shortcut_oracle",
               "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
               "trainer.progress_bar=false"]  # parallel jobs' progress lines would interleave
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=REPO, env=env, check=True)
    from saopd.analysis.collect import RunQuery, load_runs, metric_histories, run_seeds

    uri = f"sqlite:///{REPO / 'mlflow.db'}"
    runs = load_runs(uri, RunQuery(experiments=("testbed",), tags={"study": "shortcut_oracle"},
                                   statuses=("FINISHED",)))
    runs = runs.assign(seed=run_seeds(runs)).sort_values("start_time")
    runs = runs.drop_duplicates("seed", keep="last")
    hist = metric_histories(uri, runs["run_id"], [ACC, SHORTCUT])
    oracle: dict[int, dict[str, float]] = {}
    for run_id, seed in zip(runs["run_id"], runs["seed"], strict=True):
        h = hist[hist.run_id == run_id]
        oracle[int(seed)] = {k: float(h[h.key == k].sort_values("step").value.iloc[-1])
                             for k in (ACC, SHORTCUT)}
    results = json.loads((OUT / "results.json").read_text(encoding="utf-8"))
    prior, clean = study_rows(results, "OPD"), study_rows(results, "OPD (clean teacher)")
    seeds = [s for s in SEEDS if s in oracle and s in prior and s in clean]
    diff = [oracle[s][ACC] - prior[s][ACC] for s in seeds]
    harm = [clean[s][ACC] - prior[s][ACC] for s in seeds]
    ratio, low, high = fieller_ratio_ci95(diff, harm)

    def fmt(vals: list[float]) -> str:
        m, h = mean_ci95(vals)
        return f"{m:.3f} ± {h:.3f}"

    lines = ["# The shortcut study's oracle (positive control)", "",
             "`experiments/testbed/shortcut_oracle.py`: OPD from the prior teacher with the first "
             "solution token of every response removed from the loss (`method=oracle_shortcut`), "
             f"seeds {seeds}, 200 steps; OPD rows from `results.json` (the same seeds).", "",
             "| row | accuracy | shortcut rate |", "|---|---|---|",
             f"| OPD (clean teacher) | {fmt([clean[s][ACC] for s in seeds])} | "
             f"{fmt([clean[s][SHORTCUT] for s in seeds])} |",
             f"| OPD (prior teacher) | {fmt([prior[s][ACC] for s in seeds])} | "
             f"{fmt([prior[s][SHORTCUT] for s in seeds])} |",
             f"| Oracle: shortcut slot | {fmt([oracle[s][ACC] for s in seeds])} | "
             f"{fmt([oracle[s][SHORTCUT] for s in seeds])} |", "",
             f"Oracle - OPD(prior), paired: {fmt(diff)}; the harm OPD(clean) - OPD(prior): "
             f"{fmt(harm)}; share of the harm the oracle recovers: {ratio:.2f} "
             f"[{low:.2f}, {high:.2f}] (Fieller 95%).", ""]
    (OUT / "shortcut_oracle.md").write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
