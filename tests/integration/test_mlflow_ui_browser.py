"""The MLflow UI, in headless Chromium, opens saopd's experiment on its runs as metric charts.

MLflow 3.17's UI starts on its GenAI view (traces) unless its "Model training" switch or the
address's ``workflowType`` parameter says otherwise (saopd.runs.ui); saopd's links carry it.
The runs are logged the way training logs them (saopd.runs.mlflow_logger.make_mlflow_logger)
to a real tracking server (saopd.runs.server). Install Chromium with ``make browser``; without
it these tests skip and say so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient
from PIL import Image

from saopd.runs.mlflow_logger import make_mlflow_logger
from saopd.runs.ui import EXPERIMENT_KIND_TAG, MODEL_TRAINING, experiment_url
from tests.helpers.net import tracking_server

CHROMIUM = shutil.which("chromium") or (
    "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium is not installed (no `chromium` on PATH or at "
    "/usr/bin/chromium); `make browser` installs it")

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--virtual-time-budget=60000", "--window-size=1400,900"]
RUNS = ("testbed-sa_opd-sampled-s0", "testbed-sa_opd-sampled-s1")


def _chromium(profile: Path, *args: str) -> str:
    cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=True).stdout


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A tracking server holding two training runs with metric histories; (its URL, the
    experiment's id)."""
    folder = tmp_path_factory.mktemp("ui")
    with tracking_server(folder) as url:
        for seed, name in enumerate(RUNS):
            logger = make_mlflow_logger(experiment_name="testbed", tracking_uri=url,
                                        run_name=name, tags={"seed": str(seed)}, root=folder)
            for step in range(10):
                logger.log_metrics({"train/loss": 1.0 / (step + 1 + seed),
                                    "train/filtered_ratio": 0.01 * step}, step=step)
            logger.finalize("success")
        yield url, logger.experiment_id


def test_the_experiment_is_declared_model_training(served: tuple[str, str]) -> None:
    url, exp_id = served
    assert MlflowClient(url).get_experiment(exp_id).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING


def test_the_link_opens_the_runs_with_their_metric_charts(served: tuple[str, str],
                                                          tmp_path: Path) -> None:
    url, exp_id = served
    dom = _chromium(tmp_path / "profile", "--dump-dom", experiment_url(url, exp_id))
    assert re.search(r"<h2[^>]*>Runs", dom)  # the runs page, not the GenAI overview
    assert "Overview" not in re.findall(r"<h2[^>]*>([^<]*)", dom)
    charts = set(re.findall(r'<h4[^>]*title="([^"]+)"', dom))
    assert {"train/loss", "train/filtered_ratio"} <= charts  # a chart per logged metric
    for name in RUNS:  # each run is a line of the charts, named in their legends
        assert f"{name} (train/loss)" in dom
    assert len(re.findall(r'class="trace scatter', dom)) >= 2 * len(charts)
    # the table view of the same runs lists them
    table = _chromium(tmp_path / "profile", "--dump-dom",
                      experiment_url(url, exp_id, charts=False))
    assert all(name in table for name in RUNS)


def test_the_screenshot_shows_the_curves(served: tuple[str, str], tmp_path: Path) -> None:
    url, exp_id = served
    shot = tmp_path / "runs.png"
    _chromium(tmp_path / "profile", f"--screenshot={shot}", experiment_url(url, exp_id))
    with Image.open(shot) as im:
        assert im.size == (1400, 900)
        rgb = np.asarray(im.convert("RGB"), dtype=float)
    # the runs' line colours: saturated pixels (not the page's greys) in the chart area
    saturation = rgb.max(axis=2) - rgb.min(axis=2)
    chart_area = saturation[150:850, 520:1000]
    assert (chart_area > 80).mean() > 0.001
    assert (rgb.mean(axis=2) < 100).mean() > 0.003  # text was drawn
