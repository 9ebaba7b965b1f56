"""Testbeds with a known ground truth: models whose spurious priors are planted by
construction, so a filter's selections can be scored against the truth."""

from saopd.testbeds import (
    planted,  # noqa: F401  (registers the ``planted`` model wrapper)
    tic,  # noqa: F401  (registers the ``tic`` wrapper and the oracle filter)
)
