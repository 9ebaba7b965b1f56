"""Resuming: the checkpoint a resume names is verified before training starts (whose run it
continues, and where: tests/hostile/test_run_folders.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from saopd.runs.checkpoints import CheckpointError, VerifiedCheckpointIO


def test_find_resume_verifies_the_checkpoint(tmp_path: Path, make_cfg) -> None:
    from saopd.config import to_train_config
    from saopd.runs.resume import find_resume

    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    VerifiedCheckpointIO().save_checkpoint({"state_dict": {}, "global_step": 1}, ckpt)
    conf = to_train_config(make_cfg("experiment=tiny", f"resume={tmp_path / 'run'}"))
    assert find_resume(conf) == ckpt
    ckpt.write_bytes(ckpt.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="is corrupt"):
        find_resume(conf)
    missing = to_train_config(make_cfg("experiment=tiny", f"resume={tmp_path / 'nope.ckpt'}"))
    with pytest.raises(FileNotFoundError, match=r"^no checkpoint at"):
        find_resume(missing)
