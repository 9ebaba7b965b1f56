"""torchmetrics for the training step: FLMR, filter ratios, divergences, grounding gaps.

Each logged name is one ``MeanMetric`` (token- or batch-weighted), so per-step values are the
batch's and epoch values (and values synchronised across ranks) are proper weighted means.
"""

from __future__ import annotations

import torch
from torch import nn
from torchmetrics import MeanMetric

# metric name -> (stats key, weight key or None). Values come from FilterResult.stats.
FILTER_METRICS: dict[str, tuple[str, str | None]] = {
    "flmr": ("flmr", None),
    "filtered_ratio": ("filtered_ratio", None),
    "alpha": ("alpha", None),
    "grounding_gap_filtered": ("grounding_gap_filtered", "n_filtered"),
    "grounding_gap_kept": ("grounding_gap_kept", "n_kept"),
    "abs_a_filtered": ("abs_a_filtered", "n_filtered"),
    "abs_a_kept": ("abs_a_kept", "n_kept"),
    "entropy_student_filtered": ("entropy_student_filtered", "n_filtered"),
    "entropy_student_kept": ("entropy_student_kept", "n_kept"),
}
STEP_METRICS = ("loss", "kl", "response_length", "step_time", "tokens", "truncated_prompts",
                "unfinished_responses")


class TrainMetrics(nn.Module):
    """One MeanMetric per logged quantity, under ``train/<name>``."""

    def __init__(self) -> None:
        super().__init__()
        names = list(FILTER_METRICS) + list(STEP_METRICS)
        self.means = nn.ModuleDict({name: MeanMetric() for name in names})

    def step(self, name: str, value: float | torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        """Accumulate one step's value (with its weight); returns the step's value to log."""
        metric = self.means[name]
        device = metric.device
        return metric(torch.as_tensor(value, dtype=torch.float32, device=device).detach(),
                      torch.as_tensor(weight, dtype=torch.float32, device=device))

    def step_filter_stats(self, stats: dict[str, float]) -> dict[str, torch.Tensor]:
        """Feed a FilterResult's stats; returns {metric name: this step's value}.

        A mean over an empty set (no filtered token) is not logged for that step.
        """
        counts = dict(stats)
        counts["n_kept"] = stats.get("n_valid", 0.0) - stats.get("n_filtered", 0.0)
        values = {}
        for name, (key, weight_key) in FILTER_METRICS.items():
            if key not in stats:
                continue
            weight = 1.0 if weight_key is None else counts[weight_key]
            if weight > 0:
                values[name] = self.step(name, stats[key], weight)
        return values

    def epoch_values(self) -> dict[str, torch.Tensor]:
        """Weighted means since the last reset (only metrics that saw an update)."""
        return {name: m.compute() for name, m in self.means.items() if m.update_count > 0}

    def reset(self) -> None:
        for metric in self.means.values():
            metric.reset()
