"""Figures: written as non-blank PNGs; the curves are the data; missing inputs are named."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from saopd.analysis.plots import (
    ENTROPY_METRICS,
    FLMR_METRIC,
    LOSS_METRIC,
    entropy_distribution_figure,
    entropy_over_steps_figure,
    loss_change,
    save_figure,
    training_dynamics_figure,
)


def _histories() -> pd.DataFrame:
    rows = []
    for run, scale in (("run-a", 1.0), ("run-b", 2.0)):
        for step in range(8):
            rows.append((run, LOSS_METRIC, step, scale / (step + 1)))
            rows.append((run, FLMR_METRIC, step, 0.02 * scale / (step + 1)))
            rows.append((run, ENTROPY_METRICS[0], step, 0.5 + 0.01 * step))
            rows.append((run, ENTROPY_METRICS[1], step, 1.5 - 0.01 * step))
    return pd.DataFrame(rows, columns=["run_id", "key", "step", "value"])


def _assert_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 5_000
    with Image.open(path) as im:
        assert im.format == "PNG" and im.width > 300 and im.height > 200
        pixels = np.asarray(im.convert("L"), dtype=float)
    assert pixels.std() > 5  # not a blank canvas
    assert (pixels < 128).mean() > 0.005  # some dark ink: axes, text, curves


def test_loss_change_is_absolute_step_difference() -> None:
    loss = pd.Series([1.0, 0.5, 0.75, 0.7], index=[0, 1, 2, 3])
    assert loss_change(loss).tolist() == pytest.approx([0.5, 0.25, 0.05])
    assert loss_change(loss).index.tolist() == [1, 2, 3]


def test_training_dynamics_figure_plots_each_run(tmp_path: Path) -> None:
    hist = _histories()
    labels = {"run-b": "SA-OPD (seed 1)", "run-a": "OPD"}
    fig = training_dynamics_figure(hist, labels, groups={"run-a": "OPD", "run-b": "SA-OPD"})
    ax_loss, ax_flmr = fig.axes
    assert [line.get_label() for line in ax_flmr.get_lines()] == ["SA-OPD (seed 1)", "OPD"]
    b = hist[(hist.run_id == "run-b") & (hist.key == FLMR_METRIC)]["value"].tolist()
    assert ax_flmr.get_lines()[0].get_ydata().tolist() == pytest.approx(b)
    loss_b = hist[(hist.run_id == "run-b") & (hist.key == LOSS_METRIC)]["value"]
    assert ax_loss.get_lines()[0].get_ydata().tolist() == pytest.approx(
        np.abs(np.diff(loss_b.to_numpy())).tolist())
    _assert_png(save_figure(fig, tmp_path / "sub" / "dyn.png"))


def test_missing_metrics_are_named() -> None:
    hist = _histories()
    with pytest.raises(ValueError, match="train/flmr"):
        training_dynamics_figure(hist[hist.key != FLMR_METRIC])
    with pytest.raises(ValueError, match="entropy_student_kept"):
        entropy_over_steps_figure(hist[hist.key != ENTROPY_METRICS[1]])
    with pytest.raises(ValueError, match="columns"):
        training_dynamics_figure(hist.drop(columns="step"))


def test_entropy_figures(tmp_path: Path) -> None:
    _assert_png(save_figure(entropy_over_steps_figure(_histories()), tmp_path / "ent.png"))
    rng = np.random.default_rng(0)
    tokens = pd.DataFrame({"entropy_student": np.r_[rng.gamma(1, 0.3, 200), rng.gamma(3, 0.5, 600)],
                           "filtered": [True] * 200 + [False] * 600})
    fig = entropy_distribution_figure(tokens, bins=20)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[0].startswith("kept (n=600") and labels[1].startswith("filtered (n=200")
    heights = [p.get_height() for p in ax.patches]
    widths = [p.get_width() for p in ax.patches]
    assert len(heights) == 40  # two histograms on 20 shared bins, each a density
    assert sum(h * w for h, w in zip(heights[:20], widths[:20], strict=True)) == pytest.approx(1)
    _assert_png(save_figure(fig, tmp_path / "hist.png"))
    with pytest.raises(ValueError, match="no student entropy"):
        entropy_distribution_figure(tokens.assign(entropy_student=np.nan))
    with pytest.raises(ValueError, match="0 filtered"):
        entropy_distribution_figure(tokens.assign(filtered=False))


def test_over_steps_draws_the_seed_mean_with_its_95_percent_band() -> None:

    from saopd.analysis.plots import over_steps_figure
    from saopd.analysis.tables import t_quantile_975

    rows = [(run, "eval/a/avg_at_1", step, value)
            for run, values in {"a": (0.1, 0.3), "b": (0.2, 0.5), "c": (0.6, 0.6)}.items()
            for step, value in zip((-1, 9), values, strict=True)]
    hist = pd.DataFrame(rows, columns=["run_id", "key", "step", "value"])
    fig = over_steps_figure(hist, {"a": "OPD", "b": "OPD", "c": "SA-OPD"},
                            [("eval/a/avg_at_1", "held-out")])
    ax = fig.axes[0]
    opd, sa = ax.get_lines()
    assert list(opd.get_xdata()) == [0.0, 10.0]  # steps trained: index + 1
    assert list(opd.get_ydata()) == pytest.approx([0.15, 0.4], rel=1e-12)
    assert list(sa.get_ydata()) == pytest.approx([0.6, 0.6], rel=1e-12)
    band = ax.collections[0].get_paths()[0].vertices[:, 1]
    half = t_quantile_975(1) * 0.1  # sd of (0.3, 0.5) = 0.2 / sqrt 2, over sqrt 2 runs
    assert band.max() == pytest.approx(0.4 + half, rel=1e-9)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["OPD (n=2)", "SA-OPD (n=1)"]
