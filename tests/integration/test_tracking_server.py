"""A real MLflow tracking server (saopd.runs.server) with many writers: two sweep jobs log
through it in parallel, saopd-report reads them back; and a sweep on several nodes over a SQLite
store refused before any job runs (the refusal itself: tests/runs/test_server.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from mlflow import MlflowClient

from saopd.report import main as report_main
from saopd.runs.ui import EXPERIMENT_KIND_TAG, MODEL_TRAINING
from tests.helpers.net import tracking_server
from tests.runs.test_server import SLURM

TRAIN = Path(sys.executable).with_name("saopd-train")
# a few seconds per job: the testbed's models, 2 steps, an evaluation of 16 held-out problems
QUICK = ["experiment=testbed", "steps=2", "prompts_per_step=8", "eval.limit=16", "eval.k=1",
         "eval.every_n_steps=2", "eval.at_start=false", "trainer.view_every_n_steps=0"]


def run_train(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``saopd-train`` with ``args`` from ``cwd``, offline, one thread per process."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("SAOPD_ROOT", None)
    return subprocess.run([str(TRAIN), *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A tracking server on 127.0.0.1 over a fresh SQLite store; (its URL, its folder)."""
    folder = tmp_path_factory.mktemp("server")
    with tracking_server(folder) as url:
        yield url, folder


def test_parallel_jobs_log_through_the_server_and_the_report_reads_them(
        server: tuple[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    url, folder = server
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    # two jobs at once (joblib, 2 processes) create the same new experiment and log through it
    out = run_train(cwd, "-m", *QUICK, "seed=0,1", "hydra/launcher=joblib",
                    "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                    f"logger.tracking_uri={url}", "logger.experiment_name=served")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "2 of 2 jobs ok" in out.stdout

    client = MlflowClient(url)
    exp = client.get_experiment_by_name("served")
    assert exp.tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING
    runs = [r for r in client.search_runs([exp.experiment_id])
            if "mlflow.parentRunId" in r.data.tags]  # the sweep's jobs, not its parent run
    assert sorted(r.data.tags["seed"] for r in runs) == ["0", "1"]
    assert {r.info.status for r in runs} == {"FINISHED"}
    for r in runs:
        assert r.data.metrics["eval/arith/avg_at_1"] >= 0.0
        # the config artifact went through the server into its artifact folder
        assert [a.path for a in client.list_artifacts(r.info.run_id, "config")] == [
            "config/config.yaml"]
    assert len(list((folder / "artifacts").rglob("config.yaml"))) == 2
    assert not (folder / "mlartifacts").exists() and not list(cwd.iterdir())

    report = tmp_path / "report"
    report_main(["--tracking-uri", url, "-e", "served", "--out", str(report),
                 "--log-to", "report"])
    printed = capsys.readouterr().out
    assert "saopd-report: 2 run(s)" in printed
    sources = pd.read_csv(report / "sources.csv")
    assert set(sources["run_id"]) == {r.info.run_id for r in runs}
    header = next(line for line in (report / "results.md").read_text().splitlines()
                  if line.startswith("| Method"))
    assert "arith" in [c.strip() for c in header.split("|")]  # the held-out metric's column
    reports = client.get_experiment_by_name("reports")
    assert client.search_runs([reports.experiment_id])  # asked for: the report run is on the
    # server too


def test_the_server_starts_no_mlflow_job_processes(server: tuple[str, Path]) -> None:
    # MLflow's job runner and its Huey consumers (a process each, ~22 s of CPU per start) are
    # off in saopd's server; the server's own processes are there (the check can see them)
    import psutil

    port = server[0].rsplit(":", 1)[1]
    mine = [p for p in psutil.process_iter(["cmdline"])
            if "server" in (p.info["cmdline"] or []) and port in (p.info["cmdline"] or [])]
    assert len(mine) == 1, [p.info["cmdline"] for p in mine]
    group = [mine[0], *mine[0].children(recursive=True)]
    commands = [" ".join(p.cmdline()) for p in group]
    assert len(group) >= 2, commands  # mlflow server and its uvicorn
    assert not [c for c in commands if "mlflow.server.jobs" in c], commands


def test_the_sweep_is_refused_before_any_job_runs(tmp_path: Path) -> None:
    out = run_train(tmp_path, "-m", "experiment=tiny", "seed=0,1",
                    f"hydra.launcher._target_={SLURM}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                    f"logger.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}")
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("saopd-train: error")]
    assert len(errors) == 1 and "SQLite is not safe with many writers" in errors[0]
    assert "logger.tracking_uri=http://" in errors[0]
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "mlflow.db").exists()
