"""saopd.signals.topk: the tail-lumped KL on K listed ids, by hand and against full KLs."""

from __future__ import annotations

import math

import pytest
import torch

from saopd.signals import LOGPROB_FLOOR
from saopd.signals.topk import bucket_kl, tail_log_mass, union_mask


def _lp(*probs: float) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()


def test_bucket_kl_by_hand() -> None:
    # teacher q = [0.5, 0.25] (tail 0.25), student p = [0.125, 0.25] (tail 0.625)
    q, p = _lp(0.5, 0.25), _lp(0.125, 0.25)
    forward = 0.5 * math.log(0.5 / 0.125) + 0.25 * math.log(0.25 / 0.625)  # ln 2 + ln(0.4)/4
    reverse = 0.125 * math.log(0.125 / 0.5) + 0.625 * math.log(0.625 / 0.25)
    assert bucket_kl(q, p).item() == pytest.approx(forward, abs=1e-7)  # 0.464074
    assert bucket_kl(p, q).item() == pytest.approx(reverse, abs=1e-7)  # 0.399395
    assert tail_log_mass(q).item() == pytest.approx(math.log(0.25))
    assert bucket_kl(q, q).item() == 0.0


def test_union_mask_drops_repeated_ids() -> None:
    first = torch.tensor([[4, 2, 9]])
    second = torch.tensor([[2, 5, 9]])
    assert union_mask(first, second).tolist() == [[True, True, True, False, True, False]]
    # the union's KL: ids 4, 2, 9, 5 each once, then the tail
    q = _lp(0.4, 0.2, 0.1, 0.2, 0.1, 0.1)[None]  # columns follow cat([first, second])
    p = _lp(0.1, 0.3, 0.2, 0.3, 0.1, 0.2)[None]
    qs, ps = [0.4, 0.2, 0.1, 0.1], [0.1, 0.3, 0.2, 0.1]
    expected = sum(a * math.log(a / b) for a, b in zip(qs, ps, strict=True))
    expected += 0.2 * math.log(0.2 / 0.3)  # tails: 1 - 0.8 and 1 - 0.7
    assert bucket_kl(q, p, union_mask(first, second)).item() == pytest.approx(expected, abs=1e-7)


@pytest.mark.parametrize("k", [1, 3, 10])
def test_bucket_kl_is_between_zero_and_the_full_kl(k: int) -> None:
    """Coarse-graining never increases a KL; with K = V (every id listed) it is the full KL."""
    g = torch.Generator().manual_seed(k)
    logq = torch.log_softmax(2 * torch.randn(50, 10, generator=g, dtype=torch.float64), -1)
    logp = torch.log_softmax(torch.randn(50, 10, generator=g, dtype=torch.float64), -1)
    ids = logq.argsort(-1, descending=True)[:, :k]
    for a, b in ((logq, logp), (logp, logq)):
        full = (a.exp() * (a - b)).sum(-1).float()
        mine = bucket_kl(a.gather(-1, ids), b.gather(-1, ids))
        assert (mine >= -1e-6).all() and (mine <= full + 1e-6).all()
        if k == 10:
            torch.testing.assert_close(mine, full, atol=1e-6, rtol=0)


def test_vanishing_tail_is_finite_with_finite_gradient() -> None:
    """Every id listed (sum exp = 1, or above by rounding): the tail is the floor, no NaN."""
    lp = torch.log_softmax(torch.randn(4, 5), -1).requires_grad_(True)
    other = torch.log_softmax(torch.randn(4, 5), -1)
    tail = tail_log_mass(lp)
    assert torch.isfinite(tail).all() and (tail >= LOGPROB_FLOOR).all()
    kl = bucket_kl(lp, other)
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(lp.grad).all()
    zeros = torch.zeros(2, 3, requires_grad=True)  # what padding holds: "probabilities" 1
    out = bucket_kl(zeros, zeros)
    out.sum().backward()
    assert torch.equal(out, torch.zeros(2)) and torch.isfinite(zeros.grad).all()


def test_gradient_through_the_tail_matches_autograd_in_float64() -> None:
    """d KL / d lp_p includes the tail's -p_k / P_tail; checked against torch.autograd on a
    direct float64 formula."""
    q = _lp(0.5, 0.25)
    p = _lp(0.125, 0.25).requires_grad_(True)
    bucket_kl(q, p).backward()
    p_ref = _lp(0.125, 0.25).requires_grad_(True)
    tail_p = torch.log1p(-p_ref.exp().sum())
    ref = (q.exp() * (q - p_ref)).sum() + 0.25 * (math.log(0.25) - tail_p)
    ref.backward()
    torch.testing.assert_close(p.grad, p_ref.grad)
    # by hand: d/d lp_k = -q_k + Q_tail * p_k / P_tail = [-0.5 + 0.25*0.2, -0.25 + 0.25*0.4]
    torch.testing.assert_close(p.grad, torch.tensor([-0.45, -0.15], dtype=torch.float64))


def test_shape_mismatch() -> None:
    with pytest.raises(ValueError, match=r"lp_from has shape \(2,\) but lp_to has \(3,\)"):
        bucket_kl(torch.zeros(2), torch.zeros(3))
