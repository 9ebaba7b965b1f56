"""What a run's log leaves out: Lightning's adverts (its other lines kept) and torch's
deprecation met inside Lightning; importing the trainer applies the filters."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator

import lightning as L
import pytest
import torch

import saopd.lightning.trainer  # noqa: F401  (importing it filters the known noise)
from saopd.runs.log import quiet_known_noise


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def lightning_info() -> Iterator[_Records]:
    """What Lightning's ``rank_zero_info`` logs, after the loggers' own filters."""
    records = _Records()
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch.utilities.rank_zero",
                                                    "lightning.fabric.utilities.rank_zero")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(records)
        lg.setLevel(logging.INFO)
    yield records
    for lg, level in zip(loggers, levels, strict=True):
        lg.removeHandler(records)
        lg.setLevel(level)


def test_lightning_adverts_are_filtered_and_its_other_lines_kept(
        lightning_info: _Records) -> None:
    L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    assert any("GPU available" in m for m in lightning_info.messages), lightning_info.messages
    assert not [m for m in lightning_info.messages if "litlogger" in m or "litmodels" in m]


def test_torchs_pytree_deprecation_in_lightning_is_filtered() -> None:
    """Lightning's ``_tree_flatten`` (every batch of a fit) makes torch's ``LeafSpec``, whose
    deprecation is not saopd's user's to act on: it warns without the filter, not with it."""
    from lightning.pytorch.utilities.combined_loader import _tree_flatten

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _tree_flatten(torch.zeros(1))
    assert any("LeafSpec" in str(w.message) for w in seen), [str(w.message) for w in seen]
    with warnings.catch_warnings(record=True) as seen:
        quiet_known_noise()
        _tree_flatten(torch.zeros(1))
        warnings.warn("another FutureWarning", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["another FutureWarning"]
