"""Top-k KL objectives (forward / reverse; tail lumped, none or renormalised) and Entropy-Aware
OPD, by hand. Against a float64 full-vocabulary reference: tests/signals/test_topk_tails.py."""

from __future__ import annotations

import math

import pytest
import torch

from saopd.filters import FILTERS
from saopd.objectives import OBJECTIVES
from saopd.signals import TokenSignals

LN = math.log


def _signals(student_grad: bool = True) -> TokenSignals:
    """One response of three tokens (the last is padding); the teacher's top-2 at each.

    [0, 0]: q = [0.5, 0.25], p = [0.125, 0.25]; [0, 1]: q = p = [0.6, 0.3]; H_T = [1.0, 0.5].
    """
    q = torch.tensor([[[0.5, 0.25], [0.6, 0.3], [0.5, 0.5]]])
    p = torch.tensor([[[0.125, 0.25], [0.6, 0.3], [0.9, 0.05]]])
    lp_s = p.log()
    if student_grad:
        lp_s.requires_grad_(True)
    lp_student = torch.tensor([[-1.0, -0.5, -3.0]], requires_grad=student_grad)
    s = TokenSignals(
        lp_student=lp_student,
        lp_teacher=torch.tensor([[-2.0, -0.25, -1.0]]),
        valid=torch.tensor([[True, True, False]]),
        entropy_teacher=torch.tensor([[1.0, 0.5, 3.0]]),
        teacher_topk_ids=torch.tensor([[[3, 1], [0, 2], [0, 1]]]),
        teacher_topk_lp_teacher=q.log(), teacher_topk_lp_student=lp_s)
    s.leaf, s.student_leaf = lp_s, lp_student  # type: ignore[attr-defined]
    return s


FORWARD_00 = 0.5 * LN(0.5 / 0.125) + 0.25 * LN(0.25 / 0.625)  # 0.464074
REVERSE_00 = 0.125 * LN(0.125 / 0.5) + 0.625 * LN(0.625 / 0.25)  # 0.399395


@pytest.mark.parametrize(("direction", "value"), [("forward", FORWARD_00),
                                                  ("reverse", REVERSE_00)])
def test_topk_kl_by_hand(direction: str, value: float) -> None:
    s = _signals()
    keep = FILTERS.build("none")(s)
    out = OBJECTIVES.build("topk_kl", direction=direction, top_k=2)(s, keep)
    torch.testing.assert_close(out.loss, torch.tensor([[value, 0.0, 0.0]]), atol=1e-6, rtol=0)
    assert out.metrics[f"kl_topk_{direction}"].item() == pytest.approx(value / 2, abs=1e-6)
    out.loss.sum().backward()
    grad = s.leaf.grad
    if direction == "forward":  # d/d lp_k = -q_k + Q_tail p_k / P_tail (module docstring)
        torch.testing.assert_close(grad[0, 0], torch.tensor([-0.45, -0.15]))
    # zero KL at [0, 1] (zero gradient up to rounding); padding carries no gradient
    torch.testing.assert_close(grad[0, 1:], torch.zeros(2, 2), atol=1e-12, rtol=0)
    assert torch.equal(grad[0, 2], torch.zeros(2))


# [0, 0] with tail none (verl): q = [0.5, 0.25], p = [0.125, 0.25], the tail dropped
NONE_00 = {"forward": 0.5 * LN(0.5 / 0.125), "reverse": 0.125 * LN(0.125 / 0.5)}
# renormalize (NeMo-RL): q~ = [2/3, 1/3], p~ = [1/3, 2/3]; both directions give ln(2) / 3
RENORM_00 = {"forward": LN(2) / 3, "reverse": LN(2) / 3}


@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize(("tail", "values"), [("none", NONE_00), ("renormalize", RENORM_00)])
def test_released_tail_modes_by_hand(direction: str, tail: str, values: dict) -> None:
    s = _signals()
    keep = FILTERS.build("none")(s)
    out = OBJECTIVES.build("topk_kl", direction=direction, top_k=2, tail=tail)(s, keep)
    torch.testing.assert_close(out.loss[0, 0], torch.tensor(values[direction]), rtol=1e-6,
                               atol=1e-7)
    assert abs(out.loss[0, 1].item()) < 1e-6  # the two agree at [0, 1]
    assert set(out.metrics) == {f"kl_topk_{direction}", "kl_sampled"}  # no tail to report
    out.loss.sum().backward()
    expected = {("none", "forward"): [-0.5, -0.25],  # d/d lp_k = -q_k
                ("renormalize", "forward"): [-1 / 3, 1 / 3]}  # p~ - q~
    if (tail, direction) in expected:
        torch.testing.assert_close(s.leaf.grad[0, 0], torch.tensor(expected[tail, direction]))
    with pytest.raises(ValueError, match="tail must be one of"):
        OBJECTIVES.build("topk_kl", tail="dropped")


def test_tail_metrics_say_where_a_list_only_tail_was_floored() -> None:
    """No exact tails in these signals (as from a teacher-scoring service): the teacher's tail
    is from its list; at [0, 1] the teacher's list is made to hold all its mass."""
    s = _signals()
    assert s.teacher_topk_lp_teacher is not None
    s.teacher_topk_lp_teacher[0, 1] = torch.tensor([0.9, 0.1]).log()
    keep = FILTERS.build("none")(s)
    out = OBJECTIVES.build("topk_kl", direction="reverse", top_k=2)(s, keep)
    assert out.metrics["topk_tail_exact_teacher"].item() == 0.0
    assert out.metrics["topk_tail_floored"].item() == 0.5  # one of the two valid positions
    # reverse at [0, 1]: p = [0.6, 0.3], P_tail = 0.1 against the floored Q_tail = 1e-6
    expected = 0.6 * LN(0.6 / 0.9) + 0.3 * LN(0.3 / 0.1) + 0.1 * (LN(0.1) - LN(1e-6))
    assert out.loss[0, 1].item() == pytest.approx(expected, rel=1e-5)
    ea = OBJECTIVES.build("entropy_aware", top_k=2)(s, keep)
    assert ea.metrics["topk_tail_floored"].item() == 0.5


def test_topk_kl_uses_the_first_k_columns() -> None:
    s = _signals()
    keep = FILTERS.build("none")(s)
    out = OBJECTIVES.build("topk_kl", top_k=1)(s, keep)
    # K = 1 at [0, 0]: q = [0.5] (tail 0.5), p = [0.125] (tail 0.875)
    expected = 0.5 * LN(0.5 / 0.125) + 0.5 * LN(0.5 / 0.875)
    assert out.loss[0, 0].item() == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match="the teacher's top-32 is needed, the signals hold top-2"):
        OBJECTIVES.build("topk_kl")(s, keep)
    with pytest.raises(ValueError, match="direction must be one of"):
        OBJECTIVES.build("topk_kl", direction="both")


def test_entropy_aware_by_hand() -> None:
    """loss_t = A_t * lpS + 1[H_T > 0.8] * forward KL_2: H_T = 1.0 at [0, 0] (gated in),
    0.5 at [0, 1] (out)."""
    s = _signals()
    keep = FILTERS.build("none")(s)
    out = OBJECTIVES.build("entropy_aware", top_k=2)(s, keep)
    a = [-1.0 - (-2.0), -0.5 - (-0.25)]  # A = lpS - lpT
    expected = [a[0] * -1.0 + FORWARD_00, a[1] * -0.5]
    torch.testing.assert_close(out.loss, torch.tensor([[*expected, 0.0]]), atol=1e-6, rtol=0)
    assert out.metrics["entropy_gated_share"].item() == 0.5
    # the sampled part's gradient is A_t on lpS; the KL part reaches the top-k log-probs
    out.loss.sum().backward()
    torch.testing.assert_close(s.student_leaf.grad, torch.tensor([[a[0], a[1], 0.0]]))
    torch.testing.assert_close(s.leaf.grad[0, 0], torch.tensor([-0.45, -0.15]))
    # coef 0, or a threshold above every entropy: vanilla OPD
    for kw in ({"coef": 0.0}, {"entropy_threshold": 5.0}):
        plain = OBJECTIVES.build("entropy_aware", top_k=2, **kw)(_signals(), keep)
        torch.testing.assert_close(plain.loss, torch.tensor([[a[0] * -1.0, a[1] * -0.5, 0.0]]))


def test_entropy_aware_threshold_is_strict() -> None:
    s = _signals(student_grad=False)
    keep = FILTERS.build("none")(s)
    out = OBJECTIVES.build("entropy_aware", top_k=2, entropy_threshold=1.0)(s, keep)
    assert out.metrics["entropy_gated_share"].item() == 0.0
    assert OBJECTIVES.build("entropy_aware", importance_ratio_cap=5.0).needs[-1] == "lp_sampler"
