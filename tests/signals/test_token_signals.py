"""TokenSignals: derived signals (Eq. 12-14), sanitising, and bad input."""

from __future__ import annotations

import pytest
import torch

from saopd.signals import LOGPROB_FLOOR, TokenSignals


def test_derived_signals_match_paper_definitions() -> None:
    valid = torch.tensor([[True, True, False]])
    s = TokenSignals(
        lp_student=torch.tensor([[-1.0, -2.0, -9.0]]),
        lp_teacher=torch.tensor([[-3.0, -0.5, -9.0]]),
        lp_student_res=torch.tensor([[-1.5, -2.0, -9.0]]),
        lp_teacher_res=torch.tensor([[-2.0, -1.0, -9.0]]),
        valid=valid,
    )
    # A_full = lpS - lpT = [2.0, -1.5]; A_res = [0.5, -1.0]; gap = |A_full - A_res| = [1.5, 0.5]
    torch.testing.assert_close(s.a_full, torch.tensor([[2.0, -1.5, 0.0]]))
    torch.testing.assert_close(s.a_res, torch.tensor([[0.5, -1.0, 0.0]]))
    torch.testing.assert_close(s.grounding_gap, torch.tensor([[1.5, 0.5, 0.0]]))
    assert s.num_valid == 2 and s.has_residual


def test_minus_inf_teacher_is_clamped_to_the_floor_and_padding_ignored() -> None:
    s = TokenSignals(
        lp_student=torch.tensor([[-1.0, float("nan")]]),  # NaN at padding is ignored
        lp_teacher=torch.tensor([[float("-inf"), float("-inf")]]),
        valid=torch.tensor([[True, False]]),
    )
    assert s.lp_teacher[0, 0].item() == LOGPROB_FLOOR
    assert s.a_full[0, 0].item() == pytest.approx(-1.0 - LOGPROB_FLOOR)
    assert torch.isfinite(s.a_full).all()
    assert s.lp_student[0, 1].item() == 0.0


def test_half_precision_inputs_are_upcast() -> None:
    s = TokenSignals(lp_student=torch.full((2, 3), -1.0, dtype=torch.bfloat16),
                     lp_teacher=torch.full((2, 3), -2.0, dtype=torch.float16),
                     valid=torch.ones(2, 3, dtype=torch.bool))
    assert s.lp_student.dtype == torch.float32 and s.lp_teacher.dtype == torch.float32
    assert torch.equal(s.a_full, torch.ones(2, 3))


def test_gradient_flows_through_lp_student_only() -> None:
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    s = TokenSignals(lp_student=lp, lp_teacher=torch.tensor([[-1.0, -1.0]]),
                     valid=torch.tensor([[True, False]]))
    assert not s.a_full.requires_grad
    s.lp_student.sum().backward()
    assert lp.grad is not None
    assert lp.grad.tolist() == [[1.0, 0.0]]  # padding receives no gradient


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lp_teacher": torch.zeros(2, 4)},
         r"lp_teacher has shape \(2, 4\) but valid has \(2, 3\)"),
        ({"valid": torch.ones(2, 3)}, "valid must be a bool tensor"),
        ({"lp_teacher": torch.zeros(2, 3, dtype=torch.long)}, "floating-point"),
        ({"lp_student_res": torch.zeros(2, 3)}, "must be given together"),
        ({"lp_teacher": torch.full((2, 3), float("nan"))}, r"lp_teacher has 6 NaN/inf .*\[0, 0\]"),
        ({"lp_teacher": torch.full((2, 3), 0.5)}, "log-probabilities must be <= 0"),
        ({"entropy_student": torch.full((2, 3), float("inf"))}, "entropy_student has 6 NaN/inf"),
    ],
)
def test_bad_input_names_the_field(kwargs: dict, match: str) -> None:
    base = {"lp_student": torch.zeros(2, 3) - 1, "lp_teacher": torch.zeros(2, 3) - 1,
            "valid": torch.ones(2, 3, dtype=torch.bool)}
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        TokenSignals(**base)


def test_missing_residual_is_reported_by_name() -> None:
    s = TokenSignals(lp_student=-torch.ones(1, 2), lp_teacher=-torch.ones(1, 2),
                     valid=torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"a_res needs TokenSignals field\(s\) \['lp_student_res'"):
        _ = s.grounding_gap
