"""Ablation filters (Table 3) and the TIP / FiRe-OPD baselines on hand-computed batches."""

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


# ---- TIP -----------------------------------------------------------------------------------
def test_tip_keeps_top_rho_per_response() -> None:
    # row 0: h = [0, 1, 2, 4]; its 98th percentile (linear) = 2 + 0.94 * 2 = 3.88, so h is
    # clipped to [0, 1, 2, 3.88]. Row 1 adds h = [0.5, 0.5, 0.5] (below the clip).
    # min-max over the batch: h_n = h / 3.88; d = kl = [1, 0, 0.5, 0 | 0, 0, 0.25] -> d_n = d / 1
    # s = h + d - h d: row 0 = [1, 0.258, 0.758, 1]; row 1 = [0.129, 0.129, 0.346]
    # keep floor(0.5 L): row 0 keeps 2 -> t0, t3 (tie at 1.0, both); row 1 keeps 1 -> t2.
    valid = torch.tensor([[True, True, True, True], [True, True, True, False]])
    s = TokenSignals(
        lp_student=-torch.ones(2, 4), lp_teacher=-torch.ones(2, 4), valid=valid,
        entropy_student=torch.tensor([[0.0, 1.0, 2.0, 4.0], [0.5, 0.5, 0.5, 0.0]]),
        kl=torch.tensor([[1.0, 0.0, 0.5, 0.0], [0.0, 0.0, 0.25, 0.0]]),
    )
    res = FILTERS.build("tip")(s)
    assert res.keep.tolist() == [[True, False, False, True], [False, False, True, False]]
    assert res.filtered.tolist() == [[False, True, True, False], [True, True, False, False]]


# ---- FiRe-OPD ------------------------------------------------------------------------------
def test_fire_drops_low_teacher_likelihood_responses_and_weights_tokens() -> None:
    # 5 responses of 2 tokens; mean lpT per row = [-1, -2, -3, -0.5, -4]: quantile(0.2) = -3.2,
    # one response below it is dropped, the one with -4. H_T = [0, 2] -> tc = [1, 0];
    # H_S = [1, 1] -> sc = [1, 1];
    # w = (1 + tc)(1 + sc) = [4, 2], mean 3 over the valid tokens -> [4/3, 2/3].
    means = torch.tensor([-1.0, -2.0, -3.0, -0.5, -4.0])
    s = TokenSignals(
        lp_student=-torch.ones(5, 2), lp_teacher=means[:, None].expand(5, 2).clone(),
        valid=torch.ones(5, 2, dtype=torch.bool),
        entropy_student=torch.ones(5, 2),
        entropy_teacher=torch.tensor([[0.0, 2.0]]).expand(5, 2).clone(),
    )
    res = FILTERS.build("fire")(s)
    assert res.filtered[:, 0].tolist() == [False, False, False, False, True]
    expected = torch.tensor([[4 / 3, 2 / 3]] * 4 + [[0.0, 0.0]])
    torch.testing.assert_close(res.weights, expected)
    assert res.stats["dropped_responses"] == 1.0


@pytest.mark.parametrize(
    ("means", "dropped"),
    [
        # 8 distinct means: quantile(0.2) = -7 + 0.4 * 1 = -6.6 (position 1.4 of the sorted
        # values) -> the 2 smallest are strictly below; floor(0.2 * 8) = 1 would drop only -8
        ([-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0], [6, 7]),
        # the quantile lands on a value (position 0.2 * 5 = 1 of 6): ties with it are kept
        ([-1.0, -2.0, -3.0, -4.0, -5.0, -6.0], [5]),
        ([-3.0, -3.0, -3.0, -3.0, -1.0], []),  # all tied at the threshold: nothing dropped
        ([-2.0], []),  # one response is its own quantile
    ],
)
def test_fire_uses_the_released_quantile_rule(means: list[float], dropped: list[int]) -> None:
    """FiRe-OPD's released code: drop mean lpT < torch.quantile(means, 0.2), ties kept."""
    n = len(means)
    lp_t = torch.tensor(means)[:, None].expand(n, 3).clone()
    valid = torch.ones(n, 3, dtype=torch.bool)
    s = TokenSignals(lp_student=-torch.ones(n, 3), lp_teacher=lp_t, valid=valid,
                     entropy_student=torch.ones(n, 3), entropy_teacher=torch.ones(n, 3))
    res = FILTERS.build("fire")(s)
    assert [i for i in range(n) if bool(res.filtered[i].all())] == dropped
    assert not bool((res.filtered.any(1) & ~res.filtered.all(1)).any())  # whole responses
    assert res.stats["dropped_responses"] == float(len(dropped))
    # an empty response (no valid token) never enters the quantile and is never "dropped"
    valid2 = torch.cat([valid, torch.zeros(1, 3, dtype=torch.bool)])
    s2 = TokenSignals(lp_student=-torch.ones(n + 1, 3),
                      lp_teacher=torch.cat([lp_t, torch.full((1, 3), -50.0)]), valid=valid2,
                      entropy_student=torch.ones(n + 1, 3), entropy_teacher=torch.ones(n + 1, 3))
    assert FILTERS.build("fire")(s2).stats["dropped_responses"] == float(len(dropped))


def test_baselines_report_missing_signals() -> None:
    s = TokenSignals(lp_student=-torch.ones(1, 2), lp_teacher=-torch.ones(1, 2),
                     valid=torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"filter 'tip' needs .*entropy_student.*kl"):
        FILTERS.build("tip")(s)
    with pytest.raises(ValueError, match=r"rho must be in \[0, 1\]"):
        FILTERS.build("tip", rho=1.5)
