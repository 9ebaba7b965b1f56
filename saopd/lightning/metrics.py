"""torchmetrics for the training step: FLMR, filter ratios, divergences, grounding gaps.

Each logged name is one ``MeanMetric`` (token- or batch-weighted), so per-step values are the
batch's and epoch values (and values synchronised across ranks) are proper weighted means.
Every statistic a filter returns (``FilterResult.stats``) is logged under ``train/<key>``: the
means over the filtered or kept tokens listed in :data:`FILTER_WEIGHTS` are token-weighted (and
skipped for a step whose set is empty); any other statistic, including ones a new filter adds,
is logged as it is, with weight 1.
"""

from __future__ import annotations

import torch
from torch import nn

#: Filter statistics that are means over a token set: stats key -> the count that weights it.
FILTER_WEIGHTS: dict[str, str] = {
    "grounding_gap_filtered": "n_filtered",
    "grounding_gap_kept": "n_kept",
    "abs_a_filtered": "n_filtered",
    "abs_a_kept": "n_kept",
    "entropy_student_filtered": "n_filtered",
    "entropy_student_kept": "n_kept",
}
STEP_METRICS = ("loss", "kl", "response_length", "step_time", "tokens", "truncated_prompts",
                "unfinished_responses")


def _mean_metric() -> nn.Module:
    """A torchmetrics ``MeanMetric``, imported on first use: torchmetrics imports transformers
    and scikit-learn (~6 s), which a search that refuses its objective metric before the first
    trial (:func:`saopd.search.train_metric_names` reads :data:`STEP_METRICS`) need not wait
    for."""
    from torchmetrics import MeanMetric

    return MeanMetric()


class TrainMetrics(nn.Module):
    """One MeanMetric per logged quantity, under ``train/<name>``."""

    def __init__(self) -> None:
        super().__init__()
        self.means = nn.ModuleDict({name: _mean_metric() for name in STEP_METRICS})

    def step(self, name: str, value: float | torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        """Accumulate one step's value (with its weight); returns the step's value to log.

        A name seen for the first time gets its own ``MeanMetric`` (on this module's device)."""
        if name not in self.means:
            device = next(iter(self.means.values())).device
            self.means[name] = _mean_metric().to(device)
        metric = self.means[name]
        device = metric.device
        return metric(torch.as_tensor(value, dtype=torch.float32, device=device).detach(),
                      torch.as_tensor(weight, dtype=torch.float32, device=device))

    def step_filter_stats(self, stats: dict[str, float]) -> dict[str, torch.Tensor]:
        """Feed every statistic of a FilterResult; returns {stats key: this step's value}.

        A mean over an empty set (no filtered, or no kept, token) is not logged for that step.
        """
        counts = dict(stats)
        counts["n_kept"] = stats.get("n_valid", 0.0) - stats.get("n_filtered", 0.0)
        values = {}
        for key, value in stats.items():
            weight_key = FILTER_WEIGHTS.get(key)
            weight = 1.0 if weight_key is None else counts.get(weight_key, 0.0)
            if weight > 0:
                values[key] = self.step(key, value, weight)
        return values

    def epoch_values(self) -> dict[str, torch.Tensor]:
        """Weighted means since the last reset (only metrics that saw an update)."""
        return {name: m.compute() for name, m in self.means.items() if m.update_count > 0}

    def reset(self) -> None:
        for metric in self.means.values():
            metric.reset()
