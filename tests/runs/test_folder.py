"""Run folders kept trustworthy: resumes continue checkpoints of the same config, one process
at a time (issue 15, points 1, 6, 10, 13)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from saopd.runs.folder import (
    RunBusyError,
    RunLock,
    check_resume_config,
    schema_defaults,
    training_config,
)


def test_training_config_keeps_what_changes_training() -> None:
    cfg = {"seed": 0, "optim": {"lr": 1e-6}, "filter": {"name": "sa_opd", "p1": 0.2},
           "paths": {"root": "/r", "output_dir": "/o"}, "logger": {"kind": "mlflow"},
           "resume": "auto", "trainer": {"devices": 2, "precision": "bf16-mixed"},
           "eval": {"every_n_steps": 8}}
    assert training_config(cfg) == {"seed": "0", "optim.lr": "1e-06",
                                    "filter.name": '"sa_opd"', "filter.p1": "0.2",
                                    "trainer.precision": '"bf16-mixed"'}


def test_a_resume_with_another_method_or_lr_is_refused_naming_the_keys() -> None:
    before = training_config({"seed": 0, "optim": {"lr": 1e-3}, "filter": {"name": "sa_opd"},
                              "objective": {"name": "sampled"}})
    now = training_config({"seed": 0, "optim": {"lr": 0.5}, "filter": {"name": "none"},
                           "objective": {"name": "full_kl"}})
    with pytest.raises(ValueError, match=r"trained checkpoint x\.ckpt .*filter\.name: "
                                         r"\"sa_opd\" -> \"none\".*optim\.lr: "
                                         r"0\.001 -> 0\.5.*resume_changes=\["):
        check_resume_config(before, now, source="checkpoint x.ckpt")
    assert check_resume_config(before, before) == {}
    # changing a key on purpose is allowed when named, and reported for the record
    lr_only = dict(before, **{"optim.lr": "0.5"})
    assert check_resume_config(before, lr_only, allowed=("optim.lr",)) == {
        "optim.lr": ("0.001", "0.5")}
    with pytest.raises(ValueError, match="seed"):
        check_resume_config(before, dict(before, seed="1"), allowed=("optim.lr",))


def test_a_setting_added_since_the_run_started_does_not_block_its_resume(tmp_path: Path,
                                                                        make_cfg) -> None:
    """A run recorded before a setting existed trained as that setting's default does: resuming
    it with the setting at its default is no change; at another value it is refused."""
    from saopd.config import to_train_config

    conf = to_train_config(make_cfg("experiment=tiny", "rollout=vllm", mlflow=False))
    defaults = schema_defaults(conf)
    assert defaults["rollout.async_steps"] == "0"  # the engine's own schema, not the base's
    assert defaults["rollout.startup_timeout"] == "600.0"
    assert "filter.p1" not in defaults  # plain mappings have no schema default
    now = training_config(dataclasses.asdict(conf))
    old = {k: v for k, v in now.items()
           if k not in ("rollout.async_steps", "rollout.startup_timeout")}
    with pytest.raises(ValueError, match=r"rollout\.async_steps: <absent> -> 0"):
        check_resume_config(old, now)  # without the defaults: as before
    assert check_resume_config(old, now, defaults=defaults) == {}
    changed = dict(now, **{"rollout.startup_timeout": "30.0"})
    with pytest.raises(ValueError, match=r"rollout.startup_timeout: <absent> -> 30.0"):
        check_resume_config(old, changed, defaults=defaults)


def test_a_second_process_on_a_run_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from saopd.runs.folder import RunLock; "
         f"lock = RunLock(Path({str(run)!r})).acquire(); print('held', flush=True); "
         "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunBusyError, match=r"is being trained by another process"):
            RunLock(run).acquire()
    finally:
        holder.kill()
        holder.wait()
    with RunLock(run):  # the killed holder released it
        pass
