"""The tracking server's checks: a SQLite store refused for launchers that run jobs on several
nodes (a Hydra callback of every sweep), and bad server arguments named (the server itself, with
many writers: tests/integration/test_tracking_server.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from saopd.runs.server import (
    StoreCheck,
    multi_node_launcher,
    server_command,
    server_environment,
    sqlite_refusal,
)
from saopd.train import CONF_DIR
from tests.conftest import REPO

SLURM = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
SUBMITIT_LOCAL = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
RAY = "hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher"
JOBLIB = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"


def test_sqlite_is_refused_for_launchers_on_several_nodes() -> None:
    store = "sqlite:////shared/repo/mlflow.db"
    assert "hydra/launcher=slurm" in sqlite_refusal(store, {"_target_": SLURM})
    assert "ray.init.address=auto" in sqlite_refusal(
        store, {"_target_": RAY, "ray": {"init": {"address": "auto"}}})
    # launchers on this machine keep SQLite; a server or a database is never refused
    for launcher in ({"_target_": SUBMITIT_LOCAL}, {"_target_": JOBLIB},
                     {"_target_": RAY, "ray": {"init": {"address": None}}}):
        assert multi_node_launcher(launcher) is None
        assert sqlite_refusal(store, launcher) is None
    for uri in ("http://node01:5000", "postgresql://db/mlflow"):
        assert sqlite_refusal(uri, {"_target_": SLURM}) is None


def test_the_check_is_a_callback_of_every_sweep(capsys: pytest.CaptureFixture) -> None:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[f"paths.root={REPO}", "paths.output_dir=/tmp/x"],
                      return_hydra_config=True)
    assert cfg.hydra.callbacks.store_check._target_ == "saopd.runs.server.StoreCheck"
    StoreCheck().on_multirun_start(cfg)  # the default launcher: nothing to refuse
    cfg.hydra.launcher._target_ = SLURM
    with pytest.raises(SystemExit) as stop:
        StoreCheck().on_multirun_start(cfg)
    assert stop.value.code == 2
    assert f"sqlite:///{REPO}/mlflow.db" in capsys.readouterr().err
    cfg.logger.kind = "none"  # nothing is logged: nothing to refuse
    StoreCheck().on_multirun_start(cfg)


def test_bad_server_arguments_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a database URI"):
        server_command(backend_store_uri=str(tmp_path / "mlruns"), artifacts_destination="a")
    out = subprocess.run([sys.executable, "-m", "saopd.runs.server", "--port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == ("saopd tracking server: error: --port must be in 1..65535, "
                                  "got 0")


def test_the_server_runs_without_mlflow_jobs_unless_the_environment_asks() -> None:
    from mlflow.environment_variables import MLFLOW_SERVER_ENABLE_JOB_EXECUTION as JOBS

    env = server_environment({"PATH": "/bin"})
    assert env == {"PATH": "/bin", JOBS.name: "false"}  # MLflow's own variable, and only it
    with pytest.MonkeyPatch.context() as mp:  # MLflow reads it as off (its default is on)
        mp.delenv(JOBS.name, raising=False)
        assert JOBS.get() is True
        mp.setenv(JOBS.name, env[JOBS.name])
        assert JOBS.get() is False
    assert server_environment({JOBS.name: "true"})[JOBS.name] == "true"  # the user's choice
