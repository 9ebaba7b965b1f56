"""Residual-pass planning: candidates, stops and the exactness certificate of skipped tokens."""

from __future__ import annotations

import pytest
import torch

from saopd.filters.sa_opd import spurious_token_mask
from saopd.scoring.residual_plan import candidate_mask, certify_selection, residual_stops


def random_batch(seed: int, b: int = 6, r: int = 40):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(b, r, generator=g)
    delta = torch.rand(b, r, generator=g)
    lengths = torch.randint(r // 2, r + 1, (b,), generator=g)
    valid = torch.arange(r)[None, :] < lengths[:, None]
    return a, delta, valid, g


@pytest.mark.parametrize("extreme", ["abs", "two_sided"])
def test_candidates_are_sa_opd_with_every_token_ungrounded(extreme):
    a, delta, valid, _ = random_batch(0)
    want = spurious_token_mask(a, delta, valid, p1=1.0, p2=0.3, extreme=extreme).mask
    assert torch.equal(candidate_mask(a, valid, 0.3, extreme=extreme), want)
    f = spurious_token_mask(a, delta, valid, p1=0.2, p2=0.3, extreme=extreme).mask
    assert not bool((f & ~want).any())  # F ⊆ C


def test_stops_are_last_candidate_plus_one():
    c = torch.tensor([[False, True, False, True, False], [False] * 5, [True] + [False] * 4])
    assert residual_stops(c).tolist() == [4, 0, 1]


def test_certified_selection_does_not_depend_on_skipped_tokens():
    """Whenever the certificate holds, any values at the skipped tokens give the same F; and
    over many batches it both holds and fails (so the test exercises both branches)."""
    seen = {True: 0, False: 0}
    for seed in range(60):
        a, delta, valid, g = random_batch(seed)
        cand = candidate_mask(a, valid, 0.1)
        stops = residual_stops(cand)
        scored = valid & (torch.arange(valid.shape[1])[None, :] < stops[:, None])
        ok, undecided = certify_selection(delta, scored, cand, valid, 0.2)
        seen[ok] += 1
        truth = spurious_token_mask(a, delta, valid, p1=0.2, p2=0.1).mask
        fills = [torch.zeros_like(delta), torch.full_like(delta, 1e6),
                 torch.rand(delta.shape, generator=g)]
        results = [spurious_token_mask(a, torch.where(scored, delta, fill), valid, p1=0.2,
                                       p2=0.1).mask for fill in fills]
        if ok:
            assert undecided == 0
            assert all(torch.equal(res, truth) for res in results)
        else:
            assert undecided > 0
            # extreme fills (all skipped below / above every scored gap) bracket the truth;
            # an undecided candidate flips between them
            assert not torch.equal(results[0], results[1])
    assert seen[True] >= 2 and seen[False] >= 10


def test_bad_inputs_are_refused():
    a, delta, valid, _ = random_batch(1)
    cand = candidate_mask(a, valid, 0.3)
    with pytest.raises(ValueError, match="contain every candidate"):
        certify_selection(delta, torch.zeros_like(valid), cand, valid, 0.2)
    with pytest.raises(ValueError, match="p2"):
        candidate_mask(a, valid, 1.5)
    with pytest.raises(ValueError, match="valid"):
        candidate_mask(a, valid.float(), 0.3)
