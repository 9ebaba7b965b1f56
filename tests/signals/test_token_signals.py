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


# ---- top-k groups ---------------------------------------------------------------------------


def _topk_group(prefix: str, k: int = 2, batch: int = 1, length: int = 3) -> dict:
    ids = torch.arange(k).expand(batch, length, k).clone()
    lp = torch.log(torch.full((batch, length, k), 0.25))
    own, other = ("teacher", "student") if prefix == "teacher" else ("student", "teacher")
    return {f"{prefix}_topk_ids": ids, f"{prefix}_topk_lp_{own}": lp,
            f"{prefix}_topk_lp_{other}": lp.clone()}


def test_topk_fields_are_sanitised_and_padding_zeroed() -> None:
    group = _topk_group("teacher")
    group["teacher_topk_lp_teacher"][0, 0, 1] = float("-inf")  # clamped to the floor
    group["teacher_topk_lp_student"][0, 2] = float("nan")  # padding: ignored, zeroed
    group["teacher_topk_ids"][0, 2] = torch.tensor([7, 7])  # repeated ids at padding: ignored
    s = TokenSignals(lp_student=torch.full((1, 3), -1.0), lp_teacher=torch.full((1, 3), -1.0),
                     valid=torch.tensor([[True, True, False]]),
                     **{k: v.to(torch.bfloat16) if "lp" in k else v for k, v in group.items()})
    assert s.teacher_topk_lp_teacher.dtype == torch.float32
    assert s.teacher_topk_lp_teacher[0, 0, 1].item() == LOGPROB_FLOOR
    assert torch.equal(s.teacher_topk_lp_student[0, 2], torch.zeros(2))
    assert torch.equal(s.teacher_topk_ids[0, 2], torch.zeros(2, dtype=torch.long))
    assert s.top_k("teacher") == 2 and s.top_k("student") == 0


def test_topk_bad_input() -> None:
    base = {"lp_student": torch.full((1, 3), -1.0), "lp_teacher": torch.full((1, 3), -1.0),
            "valid": torch.ones(1, 3, dtype=torch.bool)}
    group = _topk_group("student")
    with pytest.raises(ValueError, match="must be given together"):
        TokenSignals(**base, student_topk_ids=group["student_topk_ids"])
    bad = dict(group, student_topk_lp_teacher=group["student_topk_lp_teacher"][..., :1])
    with pytest.raises(ValueError, match="has K = 1 but student_topk_ids has K = 2"):
        TokenSignals(**base, **bad)
    bad = dict(group, student_topk_ids=group["student_topk_ids"].float())
    with pytest.raises(ValueError, match="student_topk_ids must be an integer"):
        TokenSignals(**base, **bad)
    bad = dict(group, student_topk_ids=torch.zeros(1, 3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="repeats a token id"):
        TokenSignals(**base, **bad)
    bad = dict(group, student_topk_ids=-group["student_topk_ids"] - 1)
    with pytest.raises(ValueError, match="negative token ids"):
        TokenSignals(**base, **bad)
    bad = dict(group, student_topk_lp_student=group["student_topk_lp_student"][:, :2])
    with pytest.raises(ValueError, match=r"must have shape \[B, T, K\] = \[1, 3, K >= 1\]"):
        TokenSignals(**base, **bad)
    bad = dict(group, student_topk_lp_student=group["student_topk_lp_student"] + 5)
    with pytest.raises(ValueError, match="log-probabilities must be <= 0"):
        TokenSignals(**base, **bad)
    bad = dict(group, student_topk_lp_teacher=group["student_topk_lp_teacher"].clone())
    bad["student_topk_lp_teacher"][0, 1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"NaN/inf value\(s\) at valid positions \(first at "
                                         r"\[0, 1, 0\]\)"):
        TokenSignals(**base, **bad)
    with pytest.raises(ValueError, match=r"needs TokenSignals field\(s\) \['teacher_topk_ids'"):
        TokenSignals(**base, **group).require("x", "teacher_topk_ids")
