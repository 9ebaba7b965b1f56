"""The MLflow UI, in headless Chromium, opens saopd's experiment on its key charts (held-out
accuracy, loss, FLMR, filtered ratio) when the address names saopd's stored view
(saopd.runs.ui.set_key_charts); without it the UI's own layout starts on the alphabetically
first section (here the one-point ``data/`` chart). Skips without Chromium (``make browser``)."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from saopd.runs.mlflow_logger import make_mlflow_logger
from saopd.runs.ui import KEY_CHARTS_VIEW, KEY_METRICS, experiment_url, set_key_charts
from tests.helpers.net import tracking_server

CHROMIUM = shutil.which("chromium") or (
    "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed; "
                                "`make browser` installs it")
ACCURACY = "eval/arith/avg_at_1"


def dom_of(url: str, profile: Path) -> str:
    """The page's DOM after its scripts ran (headless Chromium, a fresh profile)."""
    cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           "--disable-background-networking", "--disable-component-update",
           "--virtual-time-budget=60000", "--window-size=1400,900",
           f"--user-data-dir={profile}", "--dump-dom", url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=True).stdout


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A tracking server with two runs that log a one-point ``data/`` metric and the key
    metrics over 6 steps; the experiment holds saopd's key-charts view."""
    folder = tmp_path_factory.mktemp("keycharts")
    with tracking_server(folder) as url:
        for seed in range(2):
            logger = make_mlflow_logger(experiment_name="testbed", tracking_uri=url,
                                        run_name=f"run-{seed}", root=folder)
            logger.log_metrics({"data/train": 64.0}, step=0)
            for step in range(6):
                logger.log_metrics({ACCURACY: 0.1 * step + 0.05 * seed, "train/kl": 0.3,
                                    **{k: 1.0 / (step + 1 + seed) for k in KEY_METRICS}},
                                   step=step)
            logger.finalize("success")
        assert set_key_charts(logger.experiment, logger.experiment_id, [ACCURACY, *KEY_METRICS])
        assert not set_key_charts(logger.experiment, logger.experiment_id,
                                  [ACCURACY, *KEY_METRICS])  # stored once
        yield url, logger.experiment_id


def test_the_view_opens_on_the_key_charts_and_the_plain_page_does_not(
        served: tuple[str, str], tmp_path: Path) -> None:
    url, exp_id = served
    dom = dom_of(experiment_url(url, exp_id, view=KEY_CHARTS_VIEW), tmp_path / "a")
    charts = re.findall(r'<h4[^>]*title="([^"]+)"', dom)
    sections = re.findall(r">(Key metrics|data|eval|train)<", dom)
    assert sections[0] == "Key metrics", sections
    assert charts[:3] == [ACCURACY, "train/loss", "train/flmr"], charts
    assert "share key" not in dom  # the stored view was found
    plain = dom_of(experiment_url(url, exp_id), tmp_path / "b")
    assert re.findall(r'<h4[^>]*title="([^"]+)"', plain)[0] == "data/train"
