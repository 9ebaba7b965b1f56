"""Compose saopd-train configs for tests: paths redirected to tmp, MLflow in a tmp SQLite store."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from saopd.train import CONF_DIR

REPO = Path(CONF_DIR).parent


def compose_train(tmp: Path, *overrides: str, mlflow: bool = True) -> DictConfig:
    base = [f"paths.root={REPO}", f"paths.output_dir={tmp / 'run'}"]
    base.append(f"logger.tracking_uri=sqlite:///{tmp / 'mlflow.db'}" if mlflow else "logger=none")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("train", overrides=[*base, *overrides])


@pytest.fixture
def make_cfg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., DictConfig]:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def make(*overrides: str, mlflow: bool = True, tmp: Path | None = None) -> DictConfig:
        return compose_train(tmp or tmp_path, *overrides, mlflow=mlflow)

    return make
