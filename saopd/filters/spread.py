"""Batch normalisations that tell a spread from rounding noise.

TIP min-max normalises its per-token quantities over the batch, Token Teachability
quantile-normalises them. Stretching a batch's spread onto [0, 1] also stretches rounding noise:
a teacher mass C that is 1 for every token in exact arithmetic comes out of float32 anywhere in
[0.99999994, 1.0000001], and normalising that spread would let the noise decide which tokens are
kept. So a spread within float noise of the values' magnitude counts as none:

    span <= SPREAD_NOISE_EPS * eps(dtype) * scale,    scale = max(|lo|, |hi|)

with eps the machine epsilon of the dtype the values were computed in (float32: 1.19e-7) and
lo, hi the ends of the spread (min and max, or the two quantiles). ``SPREAD_NOISE_EPS`` = 16
(1.9e-6 relative in float32): the float32 log-probs these quantities are built from are each off
by ~1e-7..1e-6 in relative mass (``saopd.signals.topk``), and a short float32 reduction adds a few
ulps more; a spread that small orders no tokens in any meaningful way. [ours]
"""

from __future__ import annotations

import torch

SPREAD_NOISE_EPS = 16


def spread_is_noise(lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``hi - lo`` (0-d tensors, hi >= lo) is within float noise of their magnitude in
    ``dtype``: ``hi - lo <= SPREAD_NOISE_EPS * eps(dtype) * max(|lo|, |hi|)``. An exact zero
    span always is."""
    return float(hi - lo) <= noise_level(lo, hi, dtype)


def noise_level(lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype) -> float:
    """``SPREAD_NOISE_EPS * eps(dtype) * max(|lo|, |hi|)``: the largest difference between
    values of magnitude max(|lo|, |hi|) that is still rounding noise."""
    scale = max(abs(float(lo)), abs(float(hi)))
    return SPREAD_NOISE_EPS * torch.finfo(dtype).eps * scale


def min_max_normalize(x: torch.Tensor) -> torch.Tensor:
    """(x - min x) / (max x - min x) of a float 1-D tensor ``[N]`` (N >= 1), in x's dtype; a
    constant tensor, or one whose spread is noise (:func:`spread_is_noise`), maps to zeros."""
    lo, hi = x.min(), x.max()
    if spread_is_noise(lo, hi, x.dtype):
        return torch.zeros_like(x)
    return (x - lo) / (hi - lo)


def quantile_normalize(values: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """clip((x - Q_low) / (Q_high - Q_low), 0, 1) of a float 1-D tensor ``[N]`` (float64
    quantiles, linear interpolation). When the span Q_high - Q_low is noise in ``values``' dtype
    (:func:`spread_is_noise`; an exact zero span included), the values count as constant except
    those clearly above Q_low: x_norm = 1[x - Q_low > noise_level]. Empty in, empty out.
    Returns float32."""
    if values.numel() == 0:
        return values.float()
    x = values.detach().double()
    lo = torch.quantile(x, low)
    hi = torch.quantile(x, high)
    if spread_is_noise(lo, hi, values.dtype):
        return (x - lo > noise_level(lo, hi, values.dtype)).float()
    return ((x - lo) / (hi - lo)).clamp(0.0, 1.0).float()
