"""Failure behaviour of saopd-train (docs/training.md, "Failure behaviour"; issue 15): a resume
never credits another config's steps to a run, writes where it should, one writer per run, NaN stops
the run before it is saved, SIGTERM saves and exits 143."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from saopd.config import to_train_config
from saopd.runs.checkpoints import read_checkpoint
from saopd.train import UserError, train


def _run(make_cfg, *overrides: str) -> dict:
    return train(make_cfg("experiment=tiny", "steps=1", "trainer.view_every_n_steps=0",
                          *overrides, mlflow=False))


def test_a_resume_with_another_method_is_refused_naming_the_keys(make_cfg) -> None:
    first = _run(make_cfg)
    run = first["output_dir"]
    with pytest.raises(UserError, match=r"resume: the config differs .*filter\.name: "
                                        r"\"sa_opd\" -> \"none\".*optim\.lr"):
        _run(make_cfg, f"resume={run}", "steps=2", "filter=none", "optim.lr=0.5")
    # named on purpose, the change is allowed and recorded in the run folder
    again = _run(make_cfg, f"resume={run}", "steps=2", "optim.lr=0.5",
                 "resume_changes=[optim.lr]")
    assert again["steps"] == 2 and again["output_dir"] == run
    # and the resumed step trains with it (the checkpoint's optimizer held the old rate)
    optim = to_train_config(make_cfg("experiment=tiny", "optim.lr=0.5", mlflow=False)).optim
    assert first["metrics"]["train/lr"] == pytest.approx(
        to_train_config(make_cfg("experiment=tiny", mlflow=False)).optim.lr
        * optim.lr_factor(0, 1), rel=1e-6)
    assert again["metrics"]["train/lr"] == pytest.approx(0.5 * optim.lr_factor(1, 2), rel=1e-6)
    record = [json.loads(line) for line in
              (Path(run) / "saopd_resume_changes.jsonl").read_text().splitlines()]
    assert set(record[-1]["changes"]) == {"steps", "optim.lr"}


def test_a_checkpoint_copied_elsewhere_resumes_into_the_jobs_own_folder(make_cfg,
                                                                       tmp_path: Path) -> None:
    first = _run(make_cfg)
    copied = tmp_path / "tmpdir" / "last.ckpt"
    copied.parent.mkdir()
    real = Path(first["last_checkpoint"]).resolve()
    copied.write_bytes(real.read_bytes())
    (copied.parent / "last.ckpt.sha256").write_text(
        (real.parent / (real.name + ".sha256")).read_text())
    again = _run(make_cfg, f"resume={copied}", "steps=2",
                 f"paths.output_dir={tmp_path / 'job'}")
    assert Path(again["output_dir"]) == tmp_path / "job"
    assert not (copied.parent.parent / "summary.json").exists()
    assert (Path(again["output_dir"]) / "summary.json").is_file()


def test_a_second_writer_of_a_run_is_refused(make_cfg) -> None:
    first = _run(make_cfg)
    run = Path(first["output_dir"])
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; from pathlib import Path; "
         "from saopd.runs.folder import RunLock; "
         f"lock = RunLock(Path({str(run)!r})).acquire(); print('held', flush=True); "
         "time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match="is being trained by another process"):
            _run(make_cfg, f"resume={run}", "steps=2")
    finally:
        holder.kill()
        holder.wait()


def test_a_non_finite_loss_stops_the_run_before_it_is_saved(make_cfg) -> None:
    with pytest.raises(UserError, match=r"the loss is not finite \(nan\) at step 0"):
        _run(make_cfg, "objective=exopd", "objective.lam=1e38", "steps=3")


def test_sigterm_saves_the_step_and_exits_143(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("saopd-train")), "experiment=tiny", "steps=100000",
         "logger=none", "trainer.view_every_n_steps=0", "trainer.checkpoint_every_n_steps=100000",
         f"hydra.run.dir={out}"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        log = out / "train.log"
        while time.monotonic() < deadline and proc.poll() is None and not (
                log.is_file() and "models ready" in log.read_text()):
            time.sleep(0.5)
        # the wait ends on the log's line, not on the deadline (a renamed log once made this
        # test wait its whole deadline and pass anyway)
        assert proc.poll() is None and "models ready" in log.read_text(), "no 'models ready'"
        time.sleep(5)  # a few steps (no periodic checkpoint before 100,000)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert "stopped by SIGTERM" in err
    state = read_checkpoint(out / "checkpoints" / "last.ckpt")
    assert 0 < state["global_step"] < 100000
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values()
               if v.is_floating_point())


def test_saved_step_names_the_step_whether_last_ckpt_is_a_link_or_a_file(tmp_path: Path
                                                                           ) -> None:
    """A periodic save links ``last.ckpt`` to ``step_N.ckpt``; a preemption saves the step into
    ``last.ckpt`` itself: both say which step (a sweep's ``KILLED.json`` and the dead-server
    message quote it), and a file that is no checkpoint is named without a step."""
    from saopd.train import saved_step

    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    assert saved_step(tmp_path) == "no step is saved yet"
    torch.save({"global_step": 4, "state_dict": {}}, ckpts / "step_000004.ckpt")
    (ckpts / "last.ckpt").symlink_to("step_000004.ckpt")
    assert saved_step(tmp_path) == f"step 4 is saved in {ckpts / 'step_000004.ckpt'}"
    (ckpts / "last.ckpt").unlink()
    torch.save({"global_step": 7, "state_dict": {}}, ckpts / "last.ckpt")
    assert saved_step(tmp_path) == f"step 7 is saved in {ckpts / 'last.ckpt'}"
    (ckpts / "last.ckpt").write_text("not a checkpoint")
    assert saved_step(tmp_path) == f"the last saved step is in {ckpts / 'last.ckpt'}"
