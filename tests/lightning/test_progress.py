"""A run's progress (saopd.lightning.callbacks.ProgressLines): a line after the first step, at
least every ``every_s`` seconds and after the last step, one per evaluation, evaluations kept
out of s/step; nothing when ``trainer.progress_bar=false`` (the known noise a run's output leaves
out: tests/runs/test_log.py)."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from saopd.config import to_train_config
from saopd.lightning.callbacks import ProgressLines, clock_time
from saopd.lightning.trainer import build_trainer


class FakeClock:
    """Seconds that pass only when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Regression(L.LightningModule):
    """One linear layer; each step takes ``step_s`` seconds of ``clock`` and logs ``train/loss``,
    ``train/kl`` (0.1 x the step's number) and ``train/flmr``."""

    def __init__(self, clock: FakeClock, step_s: float) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.clock, self.step_s = clock, step_s

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.clock.now += self.step_s
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train/loss", loss, on_step=True, on_epoch=False)
        self.log("train/kl", 0.1 * (self.global_step + 1), on_step=True, on_epoch=False)
        self.log("train/flmr", 0.25, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class FakeEvaluation(L.Callback):
    """After step ``at``: an evaluation of ``seconds`` reported to ``progress``."""

    def __init__(self, progress: ProgressLines, clock: FakeClock, at: int, seconds: float) -> None:
        self.progress, self.clock, self.at, self.seconds = progress, clock, at, seconds

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            self.clock.now += self.seconds
            self.progress.evaluated(self.at - 1, {"eval/arith/avg_at_4": 0.5}, self.seconds)


def _loader() -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 2, generator=gen)
    return DataLoader(TensorDataset(x, x.sum(-1, keepdim=True)), batch_size=4)


def _fit(progress: ProgressLines, *callbacks: L.Callback, steps: int, module: Regression,
         tmp_path: Path) -> L.Trainer:
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_model_summary=False,
                        callbacks=[progress, *callbacks], default_root_dir=str(tmp_path))
    trainer.fit(module, _loader())
    return trainer


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "saopd.progress"]


def test_lines_after_the_first_step_every_interval_the_last_step_and_each_evaluation(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Steps of 4 s, a line at least every 10 s, a 6-s evaluation after step 3: lines after
    steps 1, 6 (12 s after the evaluation's line) and 7 (the last), each at 4 s/step (the
    evaluation's 6 s are not a step's), with the time left at the mean step."""
    caplog.set_level(logging.INFO, logger="saopd.progress")
    clock = FakeClock()
    progress = ProgressLines(10.0, still_s=None, clock=clock)
    trainer = _fit(progress, FakeEvaluation(progress, clock, at=3, seconds=6.0), steps=7,
                   module=Regression(clock, step_s=4.0), tmp_path=tmp_path)
    assert trainer.progress_bar_callback is progress  # Lightning's bar is not added
    lines = _lines(caplog)
    num = r"-?[0-9.e+-]+"
    assert lines[0] == "training 7 steps"
    assert re.fullmatch(rf"step 1/7 \| loss {num} \| kl 0\.1 \| flmr 0\.25 \| 4 s/step \| "
                        r"0:04 elapsed, ~0:24 left", lines[1]), lines[1]
    assert lines[2] == "eval after step 3 (6.0 s) | arith/avg_at_4 0.5"
    assert re.fullmatch(rf"step 6/7 \| loss {num} \| kl 0\.6 \| flmr 0\.25 \| 4 s/step \| "
                        r"0:30 elapsed, ~0:04 left", lines[3]), lines[3]
    assert re.fullmatch(rf"step 7/7 \| loss {num} \| kl 0\.7 \| flmr 0\.25 \| 4 s/step \| "
                        r"0:34 elapsed", lines[4]), lines[4]
    assert len(lines) == 5
    loss = float(trainer.callback_metrics["train/loss"])
    assert f"loss {loss:.4g} " in lines[4]  # the last step's value, not an average


def test_every_step_at_zero_seconds_and_nothing_when_disabled(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="saopd.progress")
    clock = FakeClock()
    _fit(ProgressLines(0.0, still_s=None, clock=clock), steps=3,
         module=Regression(clock, step_s=0.5), tmp_path=tmp_path / "a")
    assert [line.split(" | ")[0] for line in _lines(caplog)] == [
        "training 3 steps", "step 1/3", "step 2/3", "step 3/3"]
    caplog.clear()
    quiet = ProgressLines(0.0, clock=clock)  # its watch never starts: disabled
    quiet.disable()  # what Lightning does on every rank but global zero
    _fit(quiet, steps=3, module=Regression(clock, step_s=0.5), tmp_path=tmp_path / "b")
    quiet.evaluated(2, {"eval/arith/avg_at_4": 0.5}, 1.0)
    assert _lines(caplog) == []
    with pytest.raises(ValueError, match="every_s"):
        ProgressLines(-1.0)
    with pytest.raises(ValueError, match="still_s"):
        ProgressLines(still_s=0)


class SlowStep(Regression):
    """Steps of ``seconds`` of real time."""

    def __init__(self, seconds: float) -> None:
        super().__init__(FakeClock(), step_s=0.0)
        self.seconds = seconds

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(self.seconds)
        return super().training_step(batch, batch_idx)


class SlowEvaluation(L.Callback):
    """An evaluation of ``seconds`` before the first step, told to ``progress``."""

    def __init__(self, progress: ProgressLines, seconds: float) -> None:
        self.progress, self.seconds = progress, seconds

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.progress.evaluating(-1, {"arith": 200}, 4)
        time.sleep(self.seconds)
        self.progress.evaluated(-1, {"eval/arith/avg_at_4": 0.5}, self.seconds)


def test_a_long_step_or_evaluation_says_it_is_still_running(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Silent stretches longer than ``still_s`` get a line naming what runs; the watch ends
    with training."""
    caplog.set_level(logging.INFO, logger="saopd.progress")
    progress = ProgressLines(100.0, still_s=0.3)
    _fit(progress, SlowEvaluation(progress, 1.0), steps=2, module=SlowStep(1.0),
         tmp_path=tmp_path)
    lines = _lines(caplog)
    still = [line.split(" still running")[0] for line in lines if " still running (" in line]
    assert "eval before training (arith 200 x 4 samples)" in still, lines
    assert "step 1/2" in still and "step 2/2" in still, lines
    assert lines.index("eval before training (1.0 s) | arith/avg_at_4 0.5") > lines.index(
        next(line for line in lines if line.startswith("eval before training (arith")))
    time.sleep(0.8)  # the watch is over: no line after the run's
    assert _lines(caplog) == lines


class FailingStep(Regression):
    """Raises in its second step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1:
            raise RuntimeError("the step failed")
        return super().training_step(batch, batch_idx)


def test_the_watch_ends_when_training_raises(tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """Lightning calls no ``teardown`` hook when training raises: the watch must end anyway,
    or (in a notebook, or a test process) it would write ``still running`` lines forever."""
    import threading

    caplog.set_level(logging.INFO, logger="saopd.progress")
    progress = ProgressLines(100.0, still_s=0.2)
    with pytest.raises(RuntimeError, match="the step failed"):
        _fit(progress, steps=4, module=FailingStep(FakeClock(), step_s=0.0), tmp_path=tmp_path)
    time.sleep(0.6)  # a watch still running would have written a line by now
    assert not [line for line in _lines(caplog) if " still running (" in line]
    assert not [t for t in threading.enumerate() if t.name == "saopd-progress" and t.is_alive()]


def test_clock_time() -> None:
    assert [clock_time(s) for s in (0, 59.6, 75.4, 3600, 3725)] == [
        "0:00", "1:00", "1:15", "1:00:00", "1:02:05"]


def test_the_trainer_shows_progress_unless_it_is_off(tmp_path: Path, make_cfg: Any) -> None:
    conf = to_train_config(make_cfg("experiment=tiny", mlflow=False))
    shown = build_trainer(conf, tmp_path, loggers=[], callbacks=[])
    assert isinstance(shown.progress_bar_callback, ProgressLines)
    assert shown.progress_bar_callback.every_s == conf.trainer.progress_bar_every_s == 10.0
    quiet = to_train_config(make_cfg("experiment=tiny", "trainer.progress_bar=false",
                                     mlflow=False))
    assert build_trainer(quiet, tmp_path, loggers=[], callbacks=[]).progress_bar_callback is None
    with pytest.raises(ValueError, match="progress_bar_every_s"):
        to_train_config(make_cfg("experiment=tiny", "trainer.progress_bar_every_s=-5",
                                 mlflow=False))


def test_a_testbed_run_shows_its_steps_and_evaluations(make_cfg: Any,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """``saopd-train``'s run (saopd.train.train) on the testbed: the progress lines come in
    order, with an evaluation line, scores and seconds, before training and after each step,
    and the scores are the ones the run's summary holds."""
    from saopd.train import train

    caplog.set_level(logging.INFO, logger="saopd.progress")
    summary = train(make_cfg("experiment=testbed", "steps=2", "eval.every_n_steps=1",
                             "eval.limit=4", "eval.k=1", "trainer.view_every_n_steps=0",
                             "trainer.progress_bar_every_s=0", mlflow=False))
    # a busy machine may add "still running" lines to a long step: not what is checked here
    lines = [line for line in _lines(caplog) if " still running (" not in line]
    assert [line.split(" | ")[0].split(" (")[0] for line in lines] == [
        "training 2 steps", "eval before training", "step 1/2", "eval after step 1",
        "step 2/2", "eval after step 2"], lines
    assert all(" s/step | " in lines[i] for i in (2, 4))
    for line, step in ((lines[1], "-1"), (lines[3], "0"), (lines[5], "1")):
        assert re.search(r"\(\d+\.\d s\)", line), line
        for key, value in summary["eval"][step].items():
            assert f"{key.removeprefix('eval/')} {value:.4g}" in line, (key, line)
