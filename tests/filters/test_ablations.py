"""Ablation filters (Table 3, saopd.filters.ablations) on hand-computed batches: what each
removes and the calibration to SA-OPD's share."""

from __future__ import annotations

import pytest
import torch

from saopd.filters import FILTERS
from saopd.filters.ablations import CalibratedFilter
from saopd.signals import TokenSignals
from tests.conftest import hand_signals, mask_of

# On the hand batch (see conftest), SA-OPD with p1 = p2 = 0.5 filters exactly one token (t0).
MATCH = {"p1": 0.5, "p2": 0.5}


def test_divergence_only_removes_largest_abs_a() -> None:
    res = FILTERS.build("divergence_only", **MATCH)(hand_signals())
    assert res.filtered.tolist() == mask_of({2})  # |A| = 3.0 is the largest


def test_ig_only_removes_smallest_grounding_gap() -> None:
    res = FILTERS.build("ig_only", **MATCH)(hand_signals())
    assert res.filtered.tolist() == mask_of({3})  # gap 0.0 is the smallest


def test_fixed_share_calibration() -> None:
    # share 0.5 of 6 valid tokens = 3: the three largest |A| are t2, t4, t0
    res = FILTERS.build("divergence_only", share=0.5)(hand_signals())
    assert res.filtered.tolist() == mask_of({0, 2, 4})
    assert "grounding_gap_filtered" in res.stats  # residual present, so the gap is reported


def test_random_is_reproducible_and_matches_the_count() -> None:
    f = FILTERS.build("random", share=0.5)
    a = f(hand_signals(), generator=torch.Generator().manual_seed(7))
    b = f(hand_signals(), generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.filtered, b.filtered)
    assert int(a.filtered.sum()) == 3
    assert not a.filtered[0, 6]  # never a padding position
    draws = {tuple(f(hand_signals(), generator=torch.Generator().manual_seed(s)).filtered[0]
                   .tolist()) for s in range(20)}
    assert len(draws) > 1


def test_random_does_not_need_residual_with_a_fixed_share() -> None:
    assert FILTERS.build("random", share=0.1).needs == ()
    assert "lp_teacher_res" in FILTERS.build("random").needs  # matching SA-OPD needs it


def proxy_signals() -> TokenSignals:
    # lpS = -1; lpT = [-3, -1.5, -1, -2] -> A = [2, 0.5, 0, 1]; Top_2(|A|) = {t0, t3}
    # lpT_res = [-3, -2.5, -1, -2.5] -> proxy |lpT - lpT_res| = [0, 1, 0, 0.5]
    #   Bottom_2(proxy) = {t0, t2} -> proxy F = {t0}
    # lpS_res = [-2, -1, -1, -1.5] -> A_res = [1, 1.5, 0, 1]; gap = [1, 1, 0, 0]
    #   Bottom_2(gap) = {t2, t3} -> SA-OPD F = {t3}
    return TokenSignals(
        lp_student=torch.tensor([[-1.0, -1.0, -1.0, -1.0]]),
        lp_teacher=torch.tensor([[-3.0, -1.5, -1.0, -2.0]]),
        lp_student_res=torch.tensor([[-2.0, -1.0, -1.0, -1.5]]),
        lp_teacher_res=torch.tensor([[-3.0, -2.5, -1.0, -2.5]]),
        valid=torch.ones(1, 4, dtype=torch.bool),
    )


def test_proxy_replacement_uses_teacher_logprob_gap() -> None:
    s = proxy_signals()
    assert FILTERS.build("sa_opd", p1=0.5, p2=0.5)(s).filtered.tolist() == [[0, 0, 0, 1]]
    raw = FILTERS.build("proxy_replacement", p1=0.5, p2=0.5, match_sa_opd=False)(s)
    assert raw.filtered.tolist() == [[1, 0, 0, 0]]
    matched = FILTERS.build("proxy_replacement", p1=0.5, p2=0.5)(s)  # SA-OPD removes 1 token
    assert matched.filtered.tolist() == [[1, 0, 0, 0]]


#: Every registered filter calibrated to SA-OPD's share (the ablations: a new one is covered).
CALIBRATED = [n for n in FILTERS.names() if issubclass(FILTERS.get(n), CalibratedFilter)]


def test_the_ablations_are_calibrated() -> None:
    assert {"random", "divergence_only", "ig_only", "proxy_replacement"} <= set(CALIBRATED)


@pytest.mark.parametrize("name", CALIBRATED)
def test_calibrated_share_matches_sa_opd_within_one_point(name: str, make_signals) -> None:
    s = make_signals(batch=16, length=64, seed=11)
    sa = FILTERS.build("sa_opd")(s)
    res = FILTERS.build(name)(s, generator=torch.Generator().manual_seed(0))
    assert sa.stats["n_filtered"] > 0
    assert abs(res.stats["filtered_ratio"] - sa.stats["filtered_ratio"]) <= 0.01
    if name in ("random", "divergence_only", "ig_only"):  # exact count: one criterion each
        assert res.stats["n_filtered"] == sa.stats["n_filtered"]


def test_calibration_needs_a_share() -> None:
    with pytest.raises(ValueError, match="needs a filtered share"):
        FILTERS.build("divergence_only", match_sa_opd=False)
    with pytest.raises(ValueError, match=r"share must be in \[0, 1\], got 2"):
        FILTERS.build("random", share=2)
