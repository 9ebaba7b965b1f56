"""The TIP baseline (saopd.filters.tip) on a hand-computed batch, and the baselines'
missing-signal and range errors."""

from __future__ import annotations

import pytest
import torch

from saopd.filters import FILTERS
from saopd.signals import TokenSignals


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


def test_baselines_report_missing_signals() -> None:
    s = TokenSignals(lp_student=-torch.ones(1, 2), lp_teacher=-torch.ones(1, 2),
                     valid=torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"filter 'tip' needs .*entropy_student.*kl"):
        FILTERS.build("tip")(s)
    with pytest.raises(ValueError, match=r"rho must be in \[0, 1\]"):
        FILTERS.build("tip", rho=1.5)
