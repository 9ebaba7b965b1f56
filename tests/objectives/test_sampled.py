"""The sampled OPD estimator and ExOPD (saopd.objectives.sampled): the loss and its gradient by
hand, the truncated importance ratio, the extrapolation."""

from __future__ import annotations

import math

import pytest
import torch

from saopd.filters import FILTERS
from saopd.objectives import OBJECTIVES, aggregate
from saopd.signals import TokenSignals
from tests.objectives.signals_data import ALL, signals


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
