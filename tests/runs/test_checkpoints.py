"""Checkpoints are written atomically with a checksum, refused when corrupt, truncated, not
finite or unsafe to unpickle, and last.ckpt is a link, not a second copy (issue 15, points 3-5,
13 and the disk note)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import saopd.runs.checkpoints as checkpoints
from saopd.runs.checkpoints import (
    CheckpointError,
    VerifiedCheckpointIO,
    checkpoint_step,
    read_checkpoint,
)


def _state(value: float = 1.0, step: int = 3) -> dict:
    return {"state_dict": {"student.w": torch.full((4, 4), value)}, "global_step": step}


def test_a_saved_checkpoint_reads_back_with_its_checksum(tmp_path: Path) -> None:
    path = tmp_path / "step_000003.ckpt"
    VerifiedCheckpointIO().save_checkpoint(_state(2.0), path)
    assert (tmp_path / "step_000003.ckpt.sha256").read_text().strip() == \
        checkpoints.file_sha256(path)
    assert torch.equal(read_checkpoint(path)["state_dict"]["student.w"], torch.full((4, 4), 2.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003.ckpt",
                                                          "step_000003.ckpt.sha256"]


def test_flipped_bytes_are_refused_by_path(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    VerifiedCheckpointIO().save_checkpoint(_state(), path)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"last\.ckpt is corrupt: its sha256"):
        read_checkpoint(path)


def test_a_truncated_or_foreign_file_is_refused_by_path(tmp_path: Path) -> None:
    path = tmp_path / "x.ckpt"
    VerifiedCheckpointIO().save_checkpoint(_state(), path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"x\.ckpt is corrupt"):
        read_checkpoint(path)
    (tmp_path / "x.ckpt.sha256").unlink()  # no checksum: the reader still refuses it
    with pytest.raises(CheckpointError, match=r"x\.ckpt cannot be read \(truncated"):
        read_checkpoint(path)
    notes = tmp_path / "notes.ckpt"
    notes.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match=r"notes\.ckpt cannot be read"):
        read_checkpoint(notes)


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_pickle_payload_is_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "extra": _Payload(str(marker))}, path)
    (tmp_path / "evil.ckpt.sha256").write_text(checkpoints.file_sha256(path) + "\n")
    with pytest.raises(CheckpointError, match="objects other than tensors"):
        read_checkpoint(path)
    assert not marker.exists()


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "last.ckpt"
    io = VerifiedCheckpointIO()
    io.save_checkpoint(_state(1.0, step=1), path)
    before = path.read_bytes()

    def disk_full(obj, f, *args, **kwargs):
        f.write(b"partial bytes")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoints.torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint(_state(5.0, step=2), path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.ckpt.sha256"]
    monkeypatch.undo()
    assert read_checkpoint(path)["global_step"] == 1


def test_a_non_finite_state_is_not_written(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    io = VerifiedCheckpointIO()
    io.save_checkpoint(_state(1.0, step=1), path)
    bad = _state(1.0, step=7)
    bad["state_dict"]["student.w"][0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"student\.w is not finite at step 7"):
        io.save_checkpoint(bad, path)
    assert read_checkpoint(path)["global_step"] == 1


def test_last_ckpt_is_a_link_to_the_newest_checkpoint(make_cfg) -> None:
    from saopd.train import train

    out = Path(train(make_cfg("experiment=tiny", mlflow=False))["output_dir"]) / "checkpoints"
    last = out / "last.ckpt"
    assert last.is_symlink() and last.resolve() == (out / "step_000003.ckpt").resolve()
    assert read_checkpoint(last)["global_step"] == 3
    assert sorted(p.name for p in out.iterdir()) == ["last.ckpt", "step_000003.ckpt",
                                                     "step_000003.ckpt.sha256"]
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    assert os.path.getsize(last) == os.path.getsize(out / "step_000003.ckpt")


def test_saopd_eval_refuses_a_corrupt_training_checkpoint(make_cfg) -> None:
    from saopd.config.model import ModelConfig
    from saopd.evaluate import load_checkpoint_student
    from saopd.train import train

    ckpt = Path(train(make_cfg("experiment=tiny", "steps=1", mlflow=False))["last_checkpoint"])
    _, _, step = load_checkpoint_student(ckpt, ModelConfig(tiny="qwen3"))
    assert step == 1
    real = ckpt.resolve()
    data = bytearray(real.read_bytes())
    data[-4096:-2048] = bytes(len(data[-4096:-2048]))  # 2 KiB zeroed inside the archive
    real.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"last\.ckpt .*is corrupt"):
        load_checkpoint_student(ckpt, ModelConfig(tiny="qwen3"))


def test_checkpoint_step_reads_the_step_without_verifying(tmp_path: Path) -> None:
    """The recorded step through a link or of a plain file (no sidecar, no digest: not
    verified); None for a missing file, a file that is no checkpoint and one without a step."""
    torch.save({"global_step": 12, "state_dict": {"w": torch.ones(2)}}, tmp_path / "a.ckpt")
    (tmp_path / "last.ckpt").symlink_to("a.ckpt")
    assert checkpoint_step(tmp_path / "a.ckpt") == checkpoint_step(tmp_path / "last.ckpt") == 12
    assert checkpoint_step(tmp_path / "missing.ckpt") is None
    (tmp_path / "text.ckpt").write_text("not a checkpoint")
    assert checkpoint_step(tmp_path / "text.ckpt") is None
    torch.save({"state_dict": {}}, tmp_path / "nostep.ckpt")
    assert checkpoint_step(tmp_path / "nostep.ckpt") is None

