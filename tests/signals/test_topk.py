"""saopd.signals.topk: the top-k KLs on K listed ids (tail lumped, none, renormalised), by hand
and against full KLs; the list-only tail's floor. The float64 full-vocabulary reference of the
objectives is in test_topk_tails.py."""

from __future__ import annotations

import math

import pytest
import torch

from saopd.signals.topk import (
    LIST_TAIL_FLOOR,
    bucket_kl,
    prefix_tail,
    renormalized_kl,
    tail_floored,
    tail_log_mass,
    truncated_kl,
    union_mask,
)


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
    assert torch.isfinite(tail).all() and (tail >= LIST_TAIL_FLOOR).all()
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


def test_list_only_tail_is_floored_at_a_resolvable_mass_not_at_minus_100() -> None:
    """A list whose float32 mass rounds to 1 gives the tail log(1e-6) ~ -13.8, the smallest a
    float32 list resolves (issue 25: it gave -100, so P_tail (log P_tail - log Q_tail) became
    P_tail (log P_tail + 100)); above the floor the tail is log(1 - sum) exactly."""
    assert math.log(1e-6) == pytest.approx(LIST_TAIL_FLOOR, rel=1e-6)
    listed = torch.tensor([[0.0, -30.0], [math.log(0.5), math.log(0.25)],
                           [math.log1p(-2e-6), -40.0]], dtype=torch.float32)
    tails = tail_log_mass(listed)
    assert tails[0].item() == LIST_TAIL_FLOOR
    assert tails[1].item() == pytest.approx(math.log(0.25), rel=1e-7)
    assert tails[2].item() == pytest.approx(math.log(2e-6), rel=1e-6)  # resolvable: kept
    assert tail_floored(listed).tolist() == [True, False, False]
    # the reverse KL of a diffuse student against a confident teacher: bounded by the floor
    p, q = _lp(0.01, 0.01).float(), torch.tensor([0.0, -30.0])
    expected = 0.01 * math.log(0.01 / 1.0) + 0.01 * (math.log(0.01) + 30)
    expected += 0.98 * (math.log(0.98) - LIST_TAIL_FLOOR)
    assert bucket_kl(p, q).item() == pytest.approx(expected, rel=1e-6)


def test_exact_tails_replace_the_list_only_ones() -> None:
    """Given tails are used as they are (no floor), on either side; the gradient reaches them."""
    q, p = _lp(0.5, 0.25), _lp(0.125, 0.25)
    t_q = torch.tensor(math.log(1e-11), dtype=torch.float64)
    t_p = torch.tensor(math.log(0.625), dtype=torch.float64, requires_grad=True)
    reverse = 0.125 * math.log(0.125 / 0.5) + 0.625 * math.log(0.625 / 1e-11)
    out = bucket_kl(p, q, tail_from=t_p, tail_to=t_q)
    assert out.item() == pytest.approx(reverse, rel=1e-6)
    out.backward()  # d/d log P_tail of P_tail (log P_tail - log Q_tail) = P_tail (1 + log ratio)
    assert t_p.grad.item() == pytest.approx(0.625 * (1 + math.log(0.625 / 1e-11)), rel=1e-6)


def test_prefix_tail_adds_the_dropped_columns_back() -> None:
    lp = _lp(0.5, 0.2, 0.1, 0.05)  # tail of all four: 0.15
    tail = torch.tensor(math.log(0.15), dtype=torch.float64)
    assert prefix_tail(lp, tail, 2).item() == pytest.approx(math.log(0.3), rel=1e-12)
    assert prefix_tail(lp, tail, 4).item() == pytest.approx(math.log(0.15), rel=1e-12)
    assert prefix_tail(lp, tail, 9).item() == pytest.approx(math.log(0.15), rel=1e-12)


def test_released_formulas_none_and_renormalize() -> None:
    """verl (tail none): sum_k p_k (log p_k - log q_k) over the ids, unnormalised; NeMo-RL
    (renormalize): the KL of the two lists each renormalised over the ids."""
    g = torch.Generator().manual_seed(3)
    a = torch.log_softmax(torch.randn(5, 30, generator=g, dtype=torch.float64), -1)[:, :8]
    b = torch.log_softmax(torch.randn(5, 30, generator=g, dtype=torch.float64), -1)[:, :8]
    verl = (a.exp() * (a - b)).sum(-1)
    pa, pb = a.exp() / a.exp().sum(-1, keepdim=True), b.exp() / b.exp().sum(-1, keepdim=True)
    nemo = (pa * (pa / pb).log()).sum(-1)
    torch.testing.assert_close(truncated_kl(a, b), verl.float(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(renormalized_kl(a, b), nemo.float(), rtol=1e-6, atol=1e-7)
    assert bool((renormalized_kl(a, b) >= 0).all())
    # the three differ: renormalising ignores the mass off the ids, lumping adds a tail term
    assert not torch.allclose(bucket_kl(a, b), truncated_kl(a, b), rtol=1e-3)
    assert not torch.allclose(renormalized_kl(a, b), truncated_kl(a, b), rtol=1e-3)
