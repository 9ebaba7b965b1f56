"""``saopd-train`` started from a directory outside the repository (a cluster job's, a
notebook's): the configs, the default data paths, the output folder and the MLflow artifacts all
resolve against the repository root (saopd.paths), not the working directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.helpers.mlflow_store import sqlite_store
from tests.helpers.vlm import synth_dir

TRAIN = Path(sys.executable).with_name("saopd-train")


def _run(cwd: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("SAOPD_ROOT", None)
    return subprocess.run([str(TRAIN), *overrides], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=900)


def _elsewhere(tmp_path: Path) -> Path:
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    assert not (cwd / "conf").exists() and REPO not in cwd.parents
    return cwd


def test_tiny_trains_from_another_directory(tmp_path: Path) -> None:
    cwd = _elsewhere(tmp_path)
    store = tmp_path / "store" / "mlflow.db"
    out = _run(cwd, "experiment=tiny", "steps=1", f"hydra.run.dir={tmp_path / 'run'}",
               f"logger.tracking_uri={sqlite_store(store)}", "trainer.view_every_n_steps=0")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 1
    assert summary["data"]["prompts_read"] == 64  # data.path: <repo>/data/gsm8k/train.jsonl
    # the run's config artifact went beside the store, not into ./mlartifacts of the cwd
    assert list((store.parent / "mlartifacts").rglob("config.yaml"))
    assert not (cwd / "mlartifacts").exists() and not (cwd / "outputs").exists()
    assert not list(cwd.iterdir())  # nothing at all was written into the working directory


def test_tiny_vlm_trains_from_another_directory(tmp_path: Path) -> None:
    cwd = _elsewhere(tmp_path)
    data = synth_dir() / "train.jsonl"
    out = _run(cwd, "experiment=tiny_vlm", "steps=1", f"data.path={data}", "logger=none",
               f"hydra.run.dir={tmp_path / 'run'}", "trainer.view_every_n_steps=0")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 1
    assert not list(cwd.iterdir())


def test_default_paths_resolve_against_the_repository(tmp_path: Path, monkeypatch) -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from saopd.train import CONF_DIR

    monkeypatch.chdir(_elsewhere(tmp_path))
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["experiment=tiny_vlm"], return_hydra_config=True)
    assert cfg.paths.root == str(REPO)
    assert cfg.data.path == f"{REPO}/data/prepared/vlm/train.jsonl"
    assert cfg.eval.data_dir == f"{REPO}/data/prepared/eval"
    run_dir = OmegaConf.select(cfg, "hydra.run.dir")
    assert run_dir.startswith(f"{REPO}/outputs/tiny_vlm/")
    assert OmegaConf.select(cfg, "hydra.sweep.dir").startswith(f"{REPO}/multirun/tiny_vlm/")
    for study in sorted(p.stem for p in (REPO / "conf" / "study").glob("*.yaml")):
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose("train", overrides=["experiment=tiny", f"study={study}"],
                          return_hydra_config=True)
        assert OmegaConf.select(cfg, "hydra.sweep.dir").startswith(
            f"{REPO}/multirun/{study}/tiny/"), study


def test_saopd_root_overrides_the_repository(tmp_path: Path, monkeypatch) -> None:
    from saopd.paths import repo_root

    monkeypatch.setenv("SAOPD_ROOT", str(REPO))
    assert repo_root() == REPO
    monkeypatch.setenv("SAOPD_ROOT", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"SAOPD_ROOT=.* is not a saopd repository"):
        repo_root()
