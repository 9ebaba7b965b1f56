"""Vanilla OPD's filter (saopd.filters.none): every valid token is kept, with weight 1."""

from __future__ import annotations

import torch

from saopd.filters import FILTERS
from saopd.signals import TokenSignals


def test_none_keeps_every_valid_token_and_filters_nothing() -> None:
    valid = torch.tensor([[True, True, False], [True, False, False]])
    s = TokenSignals(lp_student=-torch.rand(2, 3), lp_teacher=-torch.rand(2, 3), valid=valid)
    f = FILTERS.build("none")
    assert f.needs == ()  # no residual pass, no extra signal
    result = f(s)
    assert torch.equal(result.keep, valid)
    assert not result.filtered.any()
    assert torch.equal(result.weights, valid.float())
    assert result.stats["filtered_ratio"] == 0.0
