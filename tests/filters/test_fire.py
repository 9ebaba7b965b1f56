"""The FiRe-OPD baseline (saopd.filters.fire) on hand-computed batches: response drops,
token weights and the released quantile rule."""

from __future__ import annotations

import pytest
import torch

from saopd.filters import FILTERS
from saopd.signals import TokenSignals


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
