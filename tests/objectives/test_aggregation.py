"""The one aggregation function (saopd.objectives.aggregation): each mode by hand, empty
masks, micro-batches that add up, bad input."""

from __future__ import annotations

import pytest
import torch

from saopd.objectives import OBJECTIVES, aggregate

# ---- aggregation ---------------------------------------------------------------------------
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), float("inf")]])


MASK = torch.tensor([[True, True, True], [True, False, False]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),  # Eq. 19: divide by |V \ F|
        ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 4 / 1) / 2),
        ("token-sum", 10.0),
    ],
)
def test_aggregation_modes_by_hand(mode: str, expected: float) -> None:
    assert aggregate(LOSS, MASK, mode).item() == pytest.approx(expected)  # NaN/inf masked out


def test_aggregation_with_no_token_is_zero_with_zero_gradient() -> None:
    loss = torch.tensor([[1.0, 2.0]], requires_grad=True)
    for mode in ("token-mean", "seq-mean-token-mean", "token-sum"):
        out = aggregate(loss, torch.zeros(1, 2, dtype=torch.bool), mode)
        (grad,) = torch.autograd.grad(out, loss)
        assert out.item() == 0.0 and torch.equal(grad, torch.zeros(1, 2))


def test_global_token_count_makes_micro_batches_add_up() -> None:
    g = torch.Generator().manual_seed(0)
    loss, mask = torch.randn(6, 5, generator=g), torch.rand(6, 5, generator=g) < 0.6
    full = aggregate(loss, mask)
    total = mask.sum()
    parts = sum(aggregate(loss[i:i + 2], mask[i:i + 2], num_tokens=total) for i in (0, 2, 4))
    torch.testing.assert_close(parts, full)
    seqs = (mask.sum(-1) > 0).sum()
    full_seq = aggregate(loss, mask, "seq-mean-token-mean")
    parts_seq = sum(aggregate(loss[i:i + 3], mask[i:i + 3], "seq-mean-token-mean",
                              num_sequences=seqs) for i in (0, 3))
    torch.testing.assert_close(parts_seq, full_seq)


def test_aggregation_bad_input() -> None:
    with pytest.raises(ValueError, match=r"mode must be one of .*got 'mean'"):
        aggregate(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        aggregate(LOSS, MASK.float())
    allowed = "allowed: entropy_aware, exopd, full_kl, sampled, topk_kl"
    with pytest.raises(ValueError, match=f"unknown objective 'kl'; {allowed}"):
        OBJECTIVES.build("kl")
    with pytest.raises(ValueError, match=r"ExOPD.lam must be >= 0, got -1"):
        OBJECTIVES.build("exopd", lam=-1)
