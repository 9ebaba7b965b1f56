"""One aggregation function for every objective: per-token loss [B, T] -> scalar.

Modes (verl's names):
- ``token-mean``: sum over loss-carrying tokens / their number. This is the paper's Eq. 19,
  which divides by |V \\ F|.
- ``seq-mean-token-mean``: token-mean inside each response, then mean over the responses that
  carry at least one token.
- ``token-sum``: plain sum over loss-carrying tokens.

Under gradient accumulation or data parallelism, pass ``num_tokens`` (or ``num_sequences``): the
number of loss-carrying tokens (responses) of the *global* batch, so every micro-batch is
normalised by the same count and the accumulated gradient equals the full-batch gradient
(normalising per micro-batch mis-weights them, a known bug in distillation trainers).
"""

from __future__ import annotations

import torch

from saopd.choices import AGGREGATIONS
from saopd.validation import check_choice, check_same_shape


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    num_tokens: float | torch.Tensor | None = None,
    num_sequences: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    Args:
        loss: float [B, T] per-token loss (already multiplied by any token weights).
        mask: bool [B, T], True = the token carries loss (kept and valid). Values of ``loss``
            elsewhere are ignored, even if NaN or inf.
        mode: one of :data:`AGGREGATIONS`.
        num_tokens: global count of loss-carrying tokens for ``token-mean`` (default: this
            batch's ``mask.sum()``).
        num_sequences: global count of responses with a loss-carrying token for
            ``seq-mean-token-mean`` (default: this batch's).

    Returns:
        0-d tensor, differentiable w.r.t. ``loss``. With no loss-carrying token the result is
        an exact 0 that still back-propagates (zero gradients), never NaN.
    """
    check_choice("mode", mode, AGGREGATIONS)
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got dtype {mask.dtype}")
    check_same_shape("loss", loss, mask.shape, "mask")
    # Sums run over the compact kept tokens (row-major), so padding cannot even change the
    # float summation order; NaN/inf at masked positions never enter.
    kept = loss[mask]  # [N_kept]
    if mode == "token-sum":
        return kept.sum()
    if mode == "token-mean":
        count = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens)
        return kept.sum() / count.to(kept.dtype).clamp_min(1.0)
    rows = mask.nonzero()[:, 0]  # [N_kept] row index of each kept token
    per_seq_sum = torch.zeros(mask.shape[0], dtype=kept.dtype, device=kept.device)
    per_seq_sum = per_seq_sum.index_add(0, rows, kept)  # [B]
    per_seq_count = mask.sum(dim=-1)  # [B]
    per_seq = per_seq_sum / per_seq_count.clamp_min(1).to(kept.dtype)  # [B]
    count = (per_seq_count > 0).sum() if num_sequences is None else torch.as_tensor(num_sequences)
    return per_seq.sum() / count.to(kept.dtype).clamp_min(1.0)
