"""Batch normalisations that tell a spread from rounding noise (saopd.filters.spread), by hand.
(How TIP and Token Teachability use them: tests/filters/test_teachability.py.)"""

from __future__ import annotations

import torch

from saopd.filters.spread import (
    SPREAD_NOISE_EPS,
    min_max_normalize,
    noise_level,
    quantile_normalize,
    spread_is_noise,
)

EPS32 = torch.finfo(torch.float32).eps


def test_noise_is_relative_to_the_magnitude_and_the_dtype() -> None:
    lo, hi = torch.tensor(100.0), torch.tensor(-200.0)
    assert noise_level(lo, hi, torch.float32) == SPREAD_NOISE_EPS * EPS32 * 200.0
    one = torch.tensor(1.0)
    assert spread_is_noise(one, one, torch.float32)  # an exact zero span
    assert spread_is_noise(torch.tensor(0.0), torch.tensor(0.0), torch.float64)
    tiny_span = torch.tensor(1.0 + 4 * EPS32, dtype=torch.float64)
    assert spread_is_noise(one.double(), tiny_span, torch.float32)  # a few ulps in float32
    assert not spread_is_noise(one.double(), tiny_span, torch.float64)  # far above float64's
    # relative to the magnitude: a span of 1e-30 between 0 and 1e-30 is all of it, not noise
    assert not spread_is_noise(torch.tensor(0.0), torch.tensor(1e-30), torch.float32)


def test_min_max_normalize_by_hand_and_on_noise() -> None:
    x = torch.tensor([2.0, 4.0, 3.0, 6.0])
    assert torch.equal(min_max_normalize(x), torch.tensor([0.0, 0.5, 0.25, 1.0]))
    assert torch.equal(min_max_normalize(torch.full((3,), 5.0)), torch.zeros(3))
    noisy = torch.tensor([1.0, 1.0 + EPS32, 1.0 - EPS32 / 2])
    assert torch.equal(min_max_normalize(noisy), torch.zeros(3))
    assert min_max_normalize(x.double()).dtype == torch.float64


def test_quantile_normalize_clips_to_the_quantiles_and_handles_noise() -> None:
    x = torch.arange(11, dtype=torch.float32)  # quantiles 0.1 -> 1.0, 0.9 -> 9.0
    got = quantile_normalize(x, 0.1, 0.9)
    want = ((x - 1.0) / 8.0).clamp(0.0, 1.0)
    assert got.dtype == torch.float32 and torch.allclose(got, want)
    assert quantile_normalize(torch.empty(0), 0.1, 0.9).numel() == 0
    # a spread of rounding noise: only the values clearly above Q_low count, as 1
    flat = torch.tensor([1.0, 1.0, 1.0, 1.0, 3.0])
    assert torch.equal(quantile_normalize(flat, 0.0, 0.5), torch.tensor([0.0, 0, 0, 0, 1]))
