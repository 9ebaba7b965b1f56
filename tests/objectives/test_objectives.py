"""Objectives (sampled OPD, full reverse KL, ExOPD) and the aggregation function."""

from __future__ import annotations

import math

import pytest
import torch

from saopd.filters import FILTERS
from saopd.objectives import OBJECTIVES, aggregate
from saopd.signals import TokenSignals

ALL = torch.ones(1, 2, dtype=torch.bool)


def signals(lp_s: list[float], lp_t: list[float], **extra: torch.Tensor) -> TokenSignals:
    leaf = torch.tensor([lp_s], requires_grad=True)
    s = TokenSignals(lp_student=leaf, lp_teacher=torch.tensor([lp_t]),
                     valid=torch.ones(1, len(lp_s), dtype=torch.bool), **extra)
    s.student_leaf = leaf  # type: ignore[attr-defined]
    return s


def test_sampled_loss_by_hand() -> None:
    # A = lpS - lpT = [2, -1]; loss_t = A_t * lpS_t = [-2, 2]; token-mean 0;
    # d loss / d lpS = A / N = [1, -0.5]
    s = signals([-1.0, -2.0], [-3.0, -1.0])
    out = OBJECTIVES.build("sampled")(s, FILTERS.build("none")(s))
    torch.testing.assert_close(out.loss, torch.tensor([[-2.0, 2.0]]))
    loss = aggregate(out.loss, ALL)
    loss.backward()
    assert loss.item() == 0.0
    torch.testing.assert_close(s.student_leaf.grad, torch.tensor([[1.0, -0.5]]))
    assert out.metrics["kl_sampled"].item() == pytest.approx(0.5)


def test_sampled_gradient_equals_a_times_grad_logprob_on_a_tiny_model() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11))
    tokens = torch.randint(0, 11, (2, 6))
    targets = torch.randint(0, 11, (2, 6))
    lp_s = torch.log_softmax(model(tokens), -1).gather(-1, targets[..., None])[..., 0]  # [2, 6]
    lp_t = -3 * torch.rand(2, 6)
    valid = torch.rand(2, 6) < 0.8
    s = TokenSignals(lp_student=lp_s, lp_teacher=lp_t, valid=valid)
    out = OBJECTIVES.build("sampled")(s, FILTERS.build("none")(s))
    grads = torch.autograd.grad(aggregate(out.loss, valid, "token-sum"), model.parameters(),
                                retain_graph=True)
    # expected: sum_t A_t * grad lpS_t over valid tokens, A_t = lpS - lpT held constant
    a = (lp_s - lp_t).detach()
    expected = torch.autograd.grad((a * lp_s)[valid].sum(), model.parameters(),
                                   retain_graph=True)
    per_token = [torch.autograd.grad(lp_s[b, t], model.parameters(), retain_graph=True)
                 for b, t in valid.nonzero().tolist()]
    by_sum = [sum(a[b, t] * g[i] for (b, t), g in zip(valid.nonzero().tolist(), per_token,
                                                       strict=True))
              for i in range(len(expected))]
    for g, e, bs in zip(grads, expected, by_sum, strict=True):
        torch.testing.assert_close(g, e)
        torch.testing.assert_close(g, bs, atol=1e-5, rtol=1e-5)


def test_truncated_importance_ratio() -> None:
    # ratio = exp(lpS - lp_sampler): [2, 10] -> truncated at 5 -> coefficients [2 A0, 5 A1]
    lp_sampler = torch.tensor([[-1.0 - math.log(2.0), -2.0 - math.log(10.0)]])
    s = signals([-1.0, -2.0], [-3.0, -1.0], lp_sampler=lp_sampler)
    out = OBJECTIVES.build("sampled", importance_ratio_cap=5.0)(s, FILTERS.build("none")(s))
    torch.testing.assert_close(out.loss, torch.tensor([[2 * 2.0 * -1.0, 5 * -1.0 * -2.0]]))
    assert out.metrics["importance_ratio_clipped"].item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match=r"objective 'sampled' needs .*lp_sampler"):
        OBJECTIVES.build("sampled", importance_ratio_cap=5.0)(signals([-1.0], [-1.0]),
                                                             FILTERS.build("none")(s))


def test_exopd_extrapolates_and_reduces_to_opd_at_lambda_one() -> None:
    # c = (lpS - lpRef) - lam (lpT - lpRef) = (-1 + 2) - 1.25 (-3 + 2) = 2.25 for token 0
    ref = torch.tensor([[-2.0, -2.0]])
    s = signals([-1.0, -2.0], [-3.0, -1.0], lp_ref=ref)
    keep = FILTERS.build("none")(s)
    ex = OBJECTIVES.build("exopd", lam=1.25)(s, keep)
    assert ex.loss[0, 0].item() == pytest.approx(2.25 * -1.0)
    one = OBJECTIVES.build("exopd", lam=1.0)(s, keep)
    torch.testing.assert_close(one.loss, OBJECTIVES.build("sampled")(s, keep).loss)


def test_full_kl_objective_passes_gradient_to_kl() -> None:
    kl = torch.tensor([[0.5, 1.5]], requires_grad=True)
    s = signals([-1.0, -2.0], [-3.0, -1.0], kl=kl)
    res = FILTERS.build("none")(s)
    loss = aggregate(OBJECTIVES.build("full_kl")(s, res).loss, res.keep)
    loss.backward()
    assert loss.item() == pytest.approx(1.0)
    torch.testing.assert_close(kl.grad, torch.tensor([[0.5, 0.5]]))


def test_filtered_tokens_carry_no_loss_and_weights_scale_it() -> None:
    s = signals([-1.0, -2.0, -0.5], [-3.0, -1.0, -0.1])
    res = FILTERS.build("none")(s)
    res.keep[0, 1] = False
    res.weights = torch.tensor([[2.0, 0.0, 1.0]])
    out = OBJECTIVES.build("sampled")(s, res)
    # A = [2, -1, -0.4]; loss = w * A * lpS = [2*2*-1, 0, -0.4*-0.5]
    torch.testing.assert_close(out.loss, torch.tensor([[-4.0, 0.0, 0.2]]))


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
