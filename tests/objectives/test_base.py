"""What every objective gets from the base class (saopd.objectives.base): filtered tokens
carry no loss and the filter's weights scale it."""

from __future__ import annotations

import torch

from saopd.filters import FILTERS
from saopd.objectives import OBJECTIVES
from tests.objectives.signals_data import signals


def test_filtered_tokens_carry_no_loss_and_weights_scale_it() -> None:
    s = signals([-1.0, -2.0, -0.5], [-3.0, -1.0, -0.1])
    res = FILTERS.build("none")(s)
    res.keep[0, 1] = False
    res.weights = torch.tensor([[2.0, 0.0, 1.0]])
    out = OBJECTIVES.build("sampled")(s, res)
    # A = [2, -1, -0.4]; loss = w * A * lpS = [2*2*-1, 0, -0.4*-0.5]
    torch.testing.assert_close(out.loss, torch.tensor([[-4.0, 0.0, 0.2]]))
