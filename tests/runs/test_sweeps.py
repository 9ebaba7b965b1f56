"""Sweeps: studies and methods compose; a failed job neither stops the sweep nor goes unseen."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from hydra import compose, initialize_config_dir

from saopd.runs.sweeps import read_jobs
from saopd.train import CONF_DIR
from tests.conftest import REPO
from tests.helpers.mlflow_store import sqlite_store

STUDIES = {
    "ablation_filters": {"method": "opd,random,divergence_only,ig_only,proxy_replacement,sa_opd"},
    "baselines": {"method": "opd,exopd,tip,fire_opd,teachability,entropy_aware,sa_opd"},
    "beta_sensitivity": {"filter": "sa_opd_flmr",
                         "filter.beta_max": "0.006,0.012,0.018,0.024,0.03"},
    "p1p2_grid": {"filter.p1": "0.1,0.2,0.3", "filter.p2": "0.2,0.3,0.4"},
}
METHODS = {"opd": ("none", "sampled", "OPD"), "exopd": ("none", "exopd", "ExOPD"),
           "tip": ("tip", "sampled", "TIP"), "fire_opd": ("fire", "sampled", "FiRe-OPD"),
           "sa_opd": ("sa_opd", "sampled", "SA-OPD"),
           "teachability": ("teachability", "sampled", "TA-OPD"),
           "entropy_aware": ("none", "entropy_aware", "Entropy-Aware OPD"),
           "random": ("random", "sampled", "Random Filter"),
           "divergence_only": ("divergence_only", "sampled", "Divergence-only Filter"),
           "ig_only": ("ig_only", "sampled", "Input-Groundedness-only Filter"),
           "proxy_replacement": ("proxy_replacement", "sampled", "Proxy Replacement")}


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("train", overrides=[f"paths.root={REPO}", "paths.output_dir=/tmp/x",
                                           *overrides], return_hydra_config=True)


@pytest.mark.parametrize("study", sorted(STUDIES))
def test_study_sweeps_what_its_readme_says(study: str) -> None:
    cfg = _compose(f"study={study}")
    assert cfg.study == study
    params = dict(cfg.hydra.sweeper.params)
    for key, values in STUDIES[study].items():
        assert params[key] == values
    assert params["seed"] == "0,1,2"
    assert cfg.eval.every_n_steps == cfg.steps  # every job ends with an evaluation
    assert (REPO / "experiments" / study / "README.md").is_file()


@pytest.mark.parametrize("method", sorted(METHODS))
def test_method_sets_filter_objective_and_label(method: str) -> None:
    cfg = _compose(f"method={method}", "experiment=tiny")
    filt, objective, label = METHODS[method]
    assert (cfg.filter.name, cfg.objective.name, cfg.method) == (filt, objective, label)


def test_failed_job_is_recorded_and_the_parallel_sweep_goes_on(tmp_path: Path) -> None:
    db = tmp_path / "mlflow.db"
    sweep = tmp_path / "sweep"
    cmd = [str(Path(sys.executable).with_name("saopd-train")), "-m", "hydra/launcher=joblib",
           "hydra.launcher.n_jobs=2", "study=p1p2_grid", "experiment=tiny", "steps=1", "seed=0",
           "filter.p1=0.5,1.5", "filter.p2=0.3", "eval.limit=2", "eval.max_new_tokens=4",
           f"hydra.sweep.dir={sweep}", f"logger.tracking_uri={sqlite_store(db)}",
           f"paths.root={REPO}", "trainer.progress_bar=false", "trainer.view_every_n_steps=0"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 1, proc.stderr[-3000:]  # the sweep ran, and says it was not clean
    assert "1 of 2 sweep jobs failed" in proc.stderr

    jobs = read_jobs(sweep)
    assert [j["status"] for j in jobs] == ["ok", "failed"]
    assert "p1 must be in [0, 1], got 1.5" in jobs[1]["error"]
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    assert (summary["jobs"], summary["failed"]) == (2, 1)
    failed = json.loads((sweep / "1" / "FAILED.json").read_text())
    assert failed["error_type"] == "UserError" and "filter.p1=1.5" in failed["overrides"]

    client = mlflow.MlflowClient(f"sqlite:///{db}")
    every = client.search_runs([e.experiment_id for e in client.search_experiments()])
    (parent,) = [r for r in every if "mlflow.parentRunId" not in r.data.tags]
    assert parent.info.status == "FAILED"  # the sweep's run says a job failed
    runs = [r for r in every if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    by_job = {r.data.tags["sweep_job"]: r for r in runs}
    assert sorted(by_job) == ["0", "1"]  # every job is one MLflow run, the failed one too
    assert by_job["0"].info.status == "FINISHED"
    assert by_job["1"].info.status == "FAILED"
    assert "got 1.5" in by_job["1"].data.tags["error"]
    for run in runs:
        assert run.data.tags["study"] == "p1p2_grid"
        assert run.data.tags["sweep"] == str(sweep.resolve())
    assert "eval/gsm8k/avg_at_1" in by_job["0"].data.metrics  # the study's final evaluation


@pytest.mark.parametrize(("launcher", "experiment", "expected"), [
    ("slurm", "math_qwen3_4b_to_1p7b", {"gpus_per_node": 1, "tasks_per_node": 1,
                                        "cpus_per_task": 8, "mem_gb": 64, "timeout_min": 1440}),
    ("slurm_local", "tiny", {"gpus_per_node": 0, "cpus_per_task": 1, "mem_gb": 4,
                             "timeout_min": 15}),
])
def test_a_cluster_launcher_asks_for_the_experiments_resources(launcher: str, experiment: str,
                                                               expected: dict) -> None:
    cfg = _compose(f"hydra/launcher={launcher}", f"experiment={experiment}")
    got = cfg.hydra.launcher
    assert {k: got[k] for k in expected} == expected
    assert got._target_.startswith("hydra_plugins.saopd_launchers.")
    cfg = _compose(f"hydra/launcher={launcher}", f"experiment={experiment}",
                   "resources.timeout_min=5")
    assert cfg.hydra.launcher.timeout_min == 5


def test_the_ray_launcher_asks_for_the_experiments_resources() -> None:
    cfg = _compose("hydra/launcher=ray_cluster", "experiment=math_qwen3_4b_to_1p7b")
    assert dict(cfg.hydra.launcher.ray.remote) == {"num_cpus": 8, "num_gpus": 1, "max_calls": 1}


def test_a_sweep_is_one_mlflow_parent_run_with_a_uniquely_named_child_per_job(
        tmp_path: Path) -> None:
    db, sweep = tmp_path / "mlflow.db", tmp_path / "sweep"
    cmd = [str(Path(sys.executable).with_name("saopd-train")), "-m", "experiment=tiny", "steps=1",
           "seed=0,1", "eval.every_n_steps=0", f"hydra.sweep.dir={sweep}",
           f"logger.tracking_uri={sqlite_store(db)}", f"paths.root={REPO}",
           "trainer.view_every_n_steps=0"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((sweep / "sweep.json").read_text())["varying"] == ["seed"]

    client = mlflow.MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name("tiny")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 2
    (parent,) = parents
    assert parent.info.status == "FINISHED"  # ended by the sweep's summary
    assert parent.data.tags["saopd.sweep"] == str(sweep.resolve())
    assert "sweep" not in parent.data.tags  # -t sweep=<dir> selects the jobs, not the parent
    # the command line's overrides (Hydra keeps hydra.* apart)
    assert parent.data.tags["overrides"].split() == [o for o in cmd[2:]
                                                     if not o.startswith("hydra.")]
    assert parent.info.run_name == f"tiny sweep {sweep.name}"
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parent.info.run_id}
    by_job = {c.data.tags["sweep_job"]: c for c in children}
    # each child named by the experiment, its job and the one override the sweep varies
    assert {j: c.info.run_name for j, c in by_job.items()} == {"0": "tiny #0 seed=0",
                                                              "1": "tiny #1 seed=1"}
    assert all(c.info.status == "FINISHED" for c in children)
