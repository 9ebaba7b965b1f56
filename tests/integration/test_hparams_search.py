"""Optuna searches through Hydra's sweeper (conf/hparams_search, saopd/search.py): short real
searches on experiment=tiny and the testbed; every trial is an MLflow run; the best point (or
the Pareto front) is printed and saved, and is what the trials' own runs say it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from mlflow import MlflowClient

from saopd.search import SearchObjectives, objective_values
from saopd.train import CONF_DIR
from tests.conftest import REPO
from tests.helpers.mlflow_store import sqlite_store

TRAIN = Path(sys.executable).with_name("saopd-train")


def run_search(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], Path, str]:
    """``saopd-train -m <args>`` from ``tmp_path``; (the process, the sweep folder, the store)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("SAOPD_ROOT", None)
    sweep, store = tmp_path / "sweep", sqlite_store(tmp_path / "mlflow.db")
    out = subprocess.run([str(TRAIN), "-m", *args, f"hydra.sweep.dir={sweep}",
                          f"logger.tracking_uri={store}", "trainer.view_every_n_steps=0"],
                         cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out, sweep, store


def trials_by_run(sweep: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in (sweep / "trials.jsonl").read_text().splitlines()]
    assert all(r["status"] == "ok" for r in rows)
    return {r["run_id"]: r for r in rows}


def test_tiny_search_finds_the_best_of_what_the_trials_logged(tmp_path: Path) -> None:
    # the loss depends on which tokens SA-OPD drops (p1 and p2): an objective with a best point
    out, sweep, store = run_search(
        tmp_path, "hparams_search=sa_opd", "experiment=tiny", "steps=2", "eval.every_n_steps=0",
        "hydra.sweeper.n_trials=4", "hydra.callbacks.search_objectives.metrics=[train/loss]",
        "hydra.sweeper.direction=[minimize]")
    trials = trials_by_run(sweep)
    assert len(trials) == 4
    client = MlflowClient(store)
    exp = client.get_experiment_by_name("tiny")
    every = client.search_runs([exp.experiment_id])
    (search,) = [r for r in every if "mlflow.parentRunId" not in r.data.tags]
    runs = [r for r in every if r.data.tags.get("mlflow.parentRunId") == search.info.run_id]
    assert {r.info.run_id for r in runs} == set(trials)  # every trial is an MLflow run
    for run in runs:
        trial = trials[run.info.run_id]
        assert run.data.tags["hparams_search"] == "sa_opd"
        assert f"filter.p1={run.data.params['filter.p1']}" in trial["overrides"]
        assert trial["values"]["train/loss"] == pytest.approx(run.data.metrics["train/loss"])
    best = json.loads((sweep / "best.json").read_text())
    assert best["objectives"] == [{"metric": "train/loss", "direction": "minimize"}]
    (point,) = best["best"]
    lowest = min(trials.values(), key=lambda t: t["values"]["train/loss"])
    assert point["run_id"] == lowest["run_id"]
    assert point["values"] == [lowest["values"]["train/loss"]]
    assert f"MLflow run {lowest['run_id']}" in out.stdout
    assert "hparams search: 4 trials (0 failed)" in out.stdout


def test_testbed_search_keeps_the_pareto_front_of_accuracy_and_shortcut(tmp_path: Path) -> None:
    out, sweep, _ = run_search(
        tmp_path, "hparams_search=sa_opd_testbed", "steps=2", "prompts_per_step=8",
        "eval.limit=16", "eval.k=1", "eval.at_start=false", "hydra.sweeper.n_trials=3")
    trials = trials_by_run(sweep)
    points = {r: (t["values"]["eval/arith/avg_at_1"], t["values"]["eval/arith/shortcut"])
              for r, t in trials.items()}

    def dominated(a: tuple[float, float]) -> bool:
        return any(b[0] >= a[0] and b[1] <= a[1] and b != a for b in points.values())

    front = {r for r, v in points.items() if not dominated(v)}
    best = json.loads((sweep / "best.json").read_text())
    assert [o["direction"] for o in best["objectives"]] == ["maximize", "minimize"]
    assert {p["run_id"] for p in best["best"]} == front
    for p in best["best"]:
        assert tuple(p["values"]) == points[p["run_id"]]
        assert set(p["params"]) == {"filter.p1", "filter.p2"}
        assert 0.05 <= p["params"]["filter.p1"] <= 0.5
    kind = "best trial" if len(front) == 1 else f"{len(front)} Pareto-optimal trials"
    assert f"maximize eval/arith/avg_at_1, minimize eval/arith/shortcut: {kind}" in out.stdout


def test_objective_values_read_the_last_evaluation_and_name_what_is_missing() -> None:
    summary = {"eval": {"-1": {"eval/a/avg_at_1": 0.1}, "9": {"eval/a/avg_at_1": 0.4}},
               "metrics": {"train/loss": 2.0, "eval/a/avg_at_1": 0.3}}
    assert objective_values(summary, ["eval/a/avg_at_1", "train/loss"]) == [0.4, 2.0]
    with pytest.raises(ValueError, match=r"'eval/b/avg_at_1' is not in the last evaluation "
                                         r"\(after step 10\).*eval/a/avg_at_1, train/loss"):
        objective_values(summary, ["eval/b/avg_at_1"])
    with pytest.raises(ValueError, match="is nan"):
        objective_values({"metrics": {"train/loss": float("nan")}}, ["train/loss"])


def test_every_search_config_pairs_its_directions_with_metrics(capsys) -> None:
    for path in sorted((REPO / "conf" / "hparams_search").glob("*.yaml")):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("train", overrides=[f"paths.root={REPO}", "paths.output_dir=/tmp/x",
                                              f"hparams_search={path.stem}"],
                          return_hydra_config=True)
        callback = SearchObjectives(cfg.hydra.callbacks.search_objectives.metrics)
        callback.on_multirun_start(cfg)  # refuses (exit 2) a config whose lists differ
        assert cfg.eval.every_n_steps == cfg.steps, path.name
        assert cfg.logger.tags.hparams_search == path.stem
        assert "optuna" in cfg.hydra.sweeper._target_
        params = dict(cfg.hydra.sweeper.params)
        assert params["filter.p1"].startswith("interval(") and "filter.p2" in params
        cfg.hydra.sweeper.direction = ["maximize", "minimize", "minimize"]
        with pytest.raises(SystemExit) as stop:
            callback.on_multirun_start(cfg)
        assert stop.value.code == 2
        assert "one metric each" in capsys.readouterr().err


def test_a_best_value_shared_by_several_trials_is_reported_as_a_tie(
        tmp_path: Path, capsys) -> None:
    """Every trial scored 0 (a search on tiny with a held-out metric): the end of the search
    says that 3 of 3 share the best value, in one line, instead of calling trial 0 best."""
    from omegaconf import OmegaConf

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    rows = [{"job": j, "overrides": [f"filter.p1={p}"], "status": "ok",
             "values": {"eval/arith/avg_at_1": 0.0}, "run_id": f"r{j}", "output_dir": str(j)}
            for j, p in enumerate((0.1, 0.2, 0.3))]
    (sweep / "trials.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    OmegaConf.save(OmegaConf.create({"name": "optuna", "best_params": {"filter.p1": 0.1},
                                     "best_value": 0.0}), sweep / "optimization_results.yaml")
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)},
                                         "sweeper": {"direction": ["maximize"]}}})
    SearchObjectives(["eval/arith/avg_at_1"]).on_multirun_end(config)
    out = capsys.readouterr().out
    ties = [line for line in out.splitlines() if "tie:" in line]
    assert ties == ["  tie: 3 of 3 completed trials (every completed trial) share the best "
                    "value 0 (#0, #1, #2); the one shown is the first of them, not a better "
                    "point: the objective does not separate these trials"]
    rows[2]["values"]["eval/arith/avg_at_1"] = 0.5  # one trial separates: no tie line
    (sweep / "trials.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    OmegaConf.save(OmegaConf.create({"name": "optuna", "best_params": {"filter.p1": 0.3},
                                     "best_value": 0.5}), sweep / "optimization_results.yaml")
    SearchObjectives(["eval/arith/avg_at_1"]).on_multirun_end(config)
    assert "tie:" not in capsys.readouterr().out
