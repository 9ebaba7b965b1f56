"""The exact reverse-KL objective (saopd.objectives.full_kl)."""

from __future__ import annotations

import pytest
import torch

from saopd.filters import FILTERS
from saopd.objectives import OBJECTIVES, aggregate
from tests.objectives.signals_data import signals


def test_full_kl_objective_passes_gradient_to_kl() -> None:
    kl = torch.tensor([[0.5, 1.5]], requires_grad=True)
    s = signals([-1.0, -2.0], [-3.0, -1.0], kl=kl)
    res = FILTERS.build("none")(s)
    loss = aggregate(OBJECTIVES.build("full_kl")(s, res).loss, res.keep)
    loss.backward()
    assert loss.item() == pytest.approx(1.0)
    torch.testing.assert_close(kl.grad, torch.tensor([[0.5, 0.5]]))
