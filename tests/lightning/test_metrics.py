"""TrainMetrics logs every statistic a filter returns, token-weighting the set means."""

from __future__ import annotations

import pytest
import torch

from saopd.lightning.metrics import FILTER_WEIGHTS, TrainMetrics


def test_every_filter_statistic_is_logged_even_a_new_one() -> None:
    m = TrainMetrics()
    stats = {"flmr": 0.1, "filtered_ratio": 0.25, "n_valid": 8.0, "n_filtered": 2.0,
             "alpha": 1.0, "p1": 0.2, "p2": 0.3, "abs_a_filtered": 3.0, "abs_a_kept": 1.0,
             "a_new_filter_statistic": 7.5}
    values = m.step_filter_stats(stats)
    assert set(values) == set(stats)
    assert values["a_new_filter_statistic"].item() == pytest.approx(7.5)
    assert values["p1"].item() == pytest.approx(0.2)


def test_set_means_are_token_weighted_and_skipped_when_the_set_is_empty() -> None:
    m = TrainMetrics()
    m.step_filter_stats({"n_valid": 10.0, "n_filtered": 1.0, "abs_a_filtered": 4.0})
    m.step_filter_stats({"n_valid": 10.0, "n_filtered": 3.0, "abs_a_filtered": 2.0})
    # epoch mean weighted by the filtered counts 1 and 3: (4 * 1 + 2 * 3) / 4
    assert m.epoch_values()["abs_a_filtered"].item() == pytest.approx(2.5)
    values = m.step_filter_stats({"n_valid": 5.0, "n_filtered": 0.0, "abs_a_filtered": 0.0,
                                  "abs_a_kept": 1.5})
    assert "abs_a_filtered" not in values  # a mean over no token is not a value
    assert values["abs_a_kept"].item() == pytest.approx(1.5)
    assert set(FILTER_WEIGHTS.values()) == {"n_filtered", "n_kept"}


def test_a_new_metric_lives_on_the_metrics_device() -> None:
    m = TrainMetrics()
    m.step_filter_stats({"something": 1.0})
    assert m.means["something"].device == torch.device("cpu")
    assert "something" in m.epoch_values()
