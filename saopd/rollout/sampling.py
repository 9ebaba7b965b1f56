"""Token samplers of the HF rollout engine's lean decode loop (``rollout.sampler``).

- ``multinomial`` (the default): ``torch.multinomial(probs, 1)``, the draw ``model.generate``
  makes, so the lean loop samples the tokens ``generate`` would for a fixed seed. Its CPU kernel
  draws one exponential variate per vocabulary entry and takes ``argmax(p / q)``: about 1.9 ms
  per call on ``[64, 681]`` (docs/benchmarks.md, "The testbed step").
- ``inverse_cdf``: one uniform per row and a binary search in the row's cumulative
  probabilities. The same distribution (each token with its probability, up to float32 rounding
  of the cumulative sum), another random stream: for a fixed seed it samples other tokens than
  ``multinomial``, so results agree only over seeds, within their intervals (the comparison is in
  docs/benchmarks.md). About 20x cheaper per call.
"""

from __future__ import annotations

import torch

from saopd.choices import ROLLOUT_SAMPLERS

__all__ = ["SAMPLERS", "inverse_cdf_index", "sample_inverse_cdf", "sample_tokens"]

#: The samplers ``rollout.sampler`` accepts.
SAMPLERS = ROLLOUT_SAMPLERS


def inverse_cdf_index(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token whose cumulative-probability interval holds ``u * total`` in each row.

    ``probs``: ``[R, V]`` non-negative, not necessarily normalised (a row's total is its sum);
    ``u``: ``[R]`` in ``[0, 1)``. Returns ``[R]`` int64: the first index ``i`` with
    ``cdf[i] > u * total`` (``right=True``, so a token of probability zero is never chosen: the
    cumulative sum does not rise at it), capped at the last token of positive probability (where
    float rounding puts ``u * total`` at or past the total).
    """
    cdf = probs.cumsum(dim=-1)  # [R, V]
    total = cdf[:, -1:]  # [R, 1]
    idx = torch.searchsorted(cdf, (u.to(cdf.dtype)[:, None] * total).contiguous(), right=True)
    last = (cdf < total).sum(dim=-1, keepdim=True)  # index of the last positive entry
    return torch.minimum(idx, last).squeeze(-1)


def sample_inverse_cdf(probs: torch.Tensor, generator: torch.Generator | None = None
                       ) -> torch.Tensor:
    """One token per row of ``probs`` ``[R, V]`` by inverse-CDF sampling: ``[R]`` int64.

    Draws ``R`` uniforms from ``generator`` (the global RNG when None) on ``probs``' device.
    """
    u = torch.rand(probs.shape[0], generator=generator, device=probs.device,
                   dtype=torch.float64 if probs.dtype == torch.float64 else torch.float32)
    return inverse_cdf_index(probs, u)


def sample_tokens(probs: torch.Tensor, sampler: str) -> torch.Tensor:
    """One token per row of ``probs`` ``[R, V]`` with the named sampler (:data:`SAMPLERS`)."""
    if sampler == "multinomial":
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    if sampler == "inverse_cdf":
        return sample_inverse_cdf(probs)
    raise ValueError(f"rollout.sampler={sampler!r}: expected one of {list(SAMPLERS)}")
