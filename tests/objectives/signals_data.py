"""Hand-written batches for the objectives' tests."""

from __future__ import annotations

import torch

from saopd.signals import TokenSignals

ALL = torch.ones(1, 2, dtype=torch.bool)


def signals(lp_s: list[float], lp_t: list[float], **extra: torch.Tensor) -> TokenSignals:
    leaf = torch.tensor([lp_s], requires_grad=True)
    s = TokenSignals(lp_student=leaf, lp_teacher=torch.tensor([lp_t]),
                     valid=torch.ones(1, len(lp_s), dtype=torch.bool), **extra)
    s.student_leaf = leaf  # type: ignore[attr-defined]
    return s
