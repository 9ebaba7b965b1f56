"""Token Teachability (TA-OPD): hand-computed scores, selection and the one-per-response rule."""

from __future__ import annotations

import math

import pytest
import torch

from saopd.filters import FILTERS, teachability_scores
from saopd.filters.spread import SPREAD_NOISE_EPS, min_max_normalize, quantile_normalize
from saopd.signals import TokenSignals
from tests.helpers.tolerance import assert_float_close

LN = math.log


def _signals() -> TokenSignals:
    """Two responses, K = 1, padding at [0, 3], [1, 2], [1, 3] (junk values there).

    Every valid token but [1, 1] has the same top-1 id for both models (id 0), so its support
    is {0} + tail. At [1, 1] the teacher's top-1 is id 0 (q 0.7, p 0.1) and the student's is
    id 1 (p 0.6, q 0.1): the support is {0, 1} + tail.
    """
    valid = torch.tensor([[True, True, True, False], [True, True, False, False]])
    q = torch.tensor([[0.9, 0.6, 0.2, 0.3], [0.5, 0.7, 0.3, 0.3]])  # teacher at its top-1
    p = torch.tensor([[0.3, 0.5, 0.1, 0.9], [0.5, 0.1, 0.9, 0.9]])  # student there
    s_ids = torch.zeros(2, 4, 1, dtype=torch.long)
    s_ids[1, 1] = 1
    s_p, s_q = p.clone(), q.clone()  # the student's top-1: the same id but at [1, 1]
    s_p[1, 1], s_q[1, 1] = 0.6, 0.1
    return TokenSignals(
        lp_student=torch.full((2, 4), -1.0), lp_teacher=torch.full((2, 4), -2.0), valid=valid,
        teacher_topk_ids=torch.zeros(2, 4, 1, dtype=torch.long),
        teacher_topk_lp_teacher=q.log()[..., None], teacher_topk_lp_student=p.log()[..., None],
        student_topk_ids=s_ids, student_topk_lp_student=s_p.log()[..., None],
        student_topk_lp_teacher=s_q.log()[..., None])


# D by hand (forward KL over the support + tail), row-major over the valid tokens
D = [0.9 * LN(0.9 / 0.3) + 0.1 * LN(0.1 / 0.7),
     0.6 * LN(0.6 / 0.5) + 0.4 * LN(0.4 / 0.5),
     0.2 * LN(0.2 / 0.1) + 0.8 * LN(0.8 / 0.9),
     0.0,
     0.7 * LN(0.7 / 0.1) + 0.1 * LN(0.1 / 0.6) + 0.2 * LN(0.2 / 0.3)]
C = [0.9, 0.6, 0.2, 0.5, 0.1]  # the teacher's mass on the student's top-1


def _qnorm(x: list[float]) -> list[float]:
    """5%-95% quantiles of 5 values by hand: positions 0.2 and 3.8 of the sorted list."""
    s = sorted(x)
    lo, hi = s[0] + 0.2 * (s[1] - s[0]), s[3] + 0.8 * (s[4] - s[3])
    return [min(max((v - lo) / (hi - lo), 0.0), 1.0) for v in x]


def test_scores_by_hand() -> None:
    parts = teachability_scores(_signals(), top_k=1)
    # float32 results of float32 log-probs: 8 ulps of the values' magnitude (~1)
    assert_float_close(parts["disagreement"], torch.tensor(D, dtype=torch.float64), ulps=8)
    assert_float_close(parts["compatibility"], torch.tensor(C, dtype=torch.float64), ulps=8)
    score = [d * c for d, c in zip(_qnorm(D), _qnorm(C), strict=True)]
    # [0.7625, 0.0104, 0.0043, 0.0, 0.0]: the largest D (at [1, 1]) has C at the 5% quantile,
    # so its score is 0 ("incompatible disagreement")
    assert_float_close(parts["score"], torch.tensor(score, dtype=torch.float64), ulps=8)
    assert score[0] == pytest.approx(0.76246, abs=1e-5) and score[4] == 0.0


@pytest.mark.parametrize(("keep_ratio", "kept", "topped_up"), [
    # floor(0.2 * 5) = 1 global token ([0, 0]); response 1 has none: its best score, 0.0, is
    # tied at [1, 0] and [1, 1], the earlier is kept
    (0.2, [[0, 0], [1, 0]], 1),
    (0.4, [[0, 0], [0, 1], [1, 0]], 1),  # floor(2.0) = 2: [0, 0], [0, 1]; then [1, 0]
    (0.0, [[0, 0], [1, 0]], 2),  # nothing globally: one per response
    (1.0, [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1]], 0),
])
def test_selection(keep_ratio: float, kept: list[list[int]], topped_up: int) -> None:
    s = _signals()
    result = FILTERS.build("teachability", keep_ratio=keep_ratio, top_k=1)(s)
    assert result.keep.nonzero().tolist() == kept
    assert torch.equal(result.keep | result.filtered, s.valid)
    assert result.stats["n_valid"] == 5.0
    assert result.stats["responses_topped_up"] == topped_up
    assert torch.equal(result.weights, result.keep.float())


def test_quantile_normalisation_edges() -> None:
    assert quantile_normalize(torch.tensor([2.0, 2.0, 2.0]), 0.05, 0.95).tolist() == [0, 0, 0]
    # 20 equal values and one larger: Q_0.05 = Q_0.95 = 1, the larger maps to 1
    x = torch.tensor([1.0] * 20 + [3.0])
    assert quantile_normalize(x, 0.05, 0.95).tolist() == [0.0] * 20 + [1.0]
    assert quantile_normalize(torch.zeros(0), 0.05, 0.95).numel() == 0


# float32 values that are 1 in exact arithmetic: one ulp below, exactly, one ulp above
NOISY_ONES = [0.99999994, 1.0, 1.0000001, 1.0, 0.99999994, 1.0000001, 1.0, 1.0]


def test_a_spread_within_float32_noise_counts_as_constant() -> None:
    x = torch.tensor(NOISY_ONES)
    assert float(x.max() - x.min()) > 0  # a real, nonzero float32 spread
    assert quantile_normalize(x, 0.05, 0.95).tolist() == [0.0] * len(NOISY_ONES)
    assert min_max_normalize(x).tolist() == [0.0] * len(NOISY_ONES)
    # an outlier beyond the noise still stands out; the noise around 1 still does not
    with_outlier = torch.tensor(NOISY_ONES * 3 + [1.5])
    assert quantile_normalize(with_outlier, 0.05, 0.95).tolist() == [0.0] * 24 + [1.0]
    # the same values in float64 are far from float64's noise: normalised as a spread
    wide = quantile_normalize(x.double(), 0.05, 0.95)
    assert wide.min() == 0.0 and wide.max() == 1.0


def test_a_spread_just_above_the_noise_is_normalised() -> None:
    eps = torch.finfo(torch.float32).eps
    step = 4 * SPREAD_NOISE_EPS * eps  # 4x the noise level at magnitude ~1
    x = torch.tensor([1.0, 1.0 + step, 1.0 + 2 * step], dtype=torch.float64).float()
    torch.testing.assert_close(min_max_normalize(x), torch.tensor([0.0, 0.5, 1.0]),
                               rtol=0.0, atol=0.02)  # the step itself is rounded to float32
    q = quantile_normalize(x, 0.0, 1.0)
    assert q[0] == 0.0 and q[2] == 1.0 and 0.0 < q[1] < 1.0


def test_compatibility_one_up_to_rounding_does_not_pick_tokens() -> None:
    """A vocabulary of K = 4 ids, so the student's top-4 holds all of the teacher's mass at every
    token: C = 1 in exact arithmetic, and float32 log-softmaxes spread it over a few ulps around
    1. C then counts as constant (C_norm = 0: every score 0, ties by position), where stretching
    the noise onto [0, 1] would rank the tokens by it."""
    g = torch.Generator().manual_seed(0)
    n, k = 40, 4
    lq = torch.log_softmax(3 * torch.randn(1, n, k, generator=g), -1)  # [1, n, K] float32
    lp = torch.log_softmax(3 * torch.randn(1, n, k, generator=g), -1)
    ids = torch.arange(k).expand(1, n, k)
    s = TokenSignals(lp_student=lp[..., 0], lp_teacher=lq[..., 0],
                     valid=torch.ones(1, n, dtype=torch.bool),
                     teacher_topk_ids=ids, teacher_topk_lp_teacher=lq,
                     teacher_topk_lp_student=lp, student_topk_ids=ids,
                     student_topk_lp_student=lp, student_topk_lp_teacher=lq)
    parts = teachability_scores(s, top_k=k)
    c = parts["compatibility"]
    assert 0 < float(c.max() - c.min()) <= 4 * torch.finfo(torch.float32).eps  # noise, not 0
    assert float(parts["disagreement"].max() - parts["disagreement"].min()) > 0.1  # D varies
    assert parts["score"].tolist() == [0.0] * n
    kept = FILTERS.build("teachability", keep_ratio=0.1, top_k=k)(s).keep
    assert kept[0].nonzero().flatten().tolist() == [0, 1, 2, 3]  # ties by position


def test_larger_k_in_the_signals_is_cut_and_smaller_refused() -> None:
    s = _signals()
    with pytest.raises(ValueError, match=r"teacher's top-16 ids, the signals hold top-1"):
        FILTERS.build("teachability")(s)
    with pytest.raises(ValueError, match="quantile_low must be < quantile_high"):
        FILTERS.build("teachability", quantile_low=0.5, quantile_high=0.5)
    with pytest.raises(ValueError, match="top_k must be an int >= 1"):
        FILTERS.build("teachability", top_k=0)
