"""Float comparisons whose tolerance follows the dtype and the magnitude of the values.

A float32 result computed two ways (another chunking, another batch layout, another CPU's
kernels: AVX2 and AVX-512 GEMMs block and sum in different orders) differs by a few units in the
last place of the *inputs'* magnitude, not by a fixed number of nats: log pi = z - logsumexp(z)
carries an absolute error of about eps * max|z| even where log pi is near 0. So the tolerance is
``ulps`` float epsilons relative to each value (rtol) plus the same relative to ``scale`` (atol),
the magnitude the values were computed from, by default the largest finite |expected|.
Bit-exactness is asserted with ``torch.equal`` instead, only where the code promises it (same
process, same kernel, e.g. a resumed run).
"""

from __future__ import annotations

import torch


def float_tolerance(dtype: torch.dtype, ulps: float, scale: float) -> tuple[float, float]:
    """``(rtol, atol)``: ``ulps`` epsilons of ``dtype``, relative and times ``scale``."""
    eps = torch.finfo(dtype).eps
    return ulps * eps, ulps * eps * scale


def assert_float_close(actual: torch.Tensor, expected: torch.Tensor, *, ulps: float,
                       scale: float | None = None, name: str | None = None) -> None:
    """``torch.testing.assert_close`` with ``float_tolerance(actual.dtype, ulps, scale)``.

    ``scale`` defaults to max |expected| over its finite entries (1 when there are none or all
    are 0); ``expected`` is cast to ``actual``'s dtype (a float64 reference is allowed);
    ``name`` prefixes the failure message."""
    expected = expected.to(actual.dtype)
    if scale is None:
        finite = expected[torch.isfinite(expected)].abs()
        scale = float(finite.max()) if finite.numel() and float(finite.max()) > 0 else 1.0
    rtol, atol = float_tolerance(actual.dtype, ulps, scale)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol,
                               msg=None if name is None else (lambda m: f"{name}: {m}"))
