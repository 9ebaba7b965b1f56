"""Checkpoint files that are whole, verified and safe to load.

:class:`VerifiedCheckpointIO` is the Trainer's checkpoint I/O (``build_trainer`` installs it):

- **atomic**: a checkpoint is written to a temporary file in its own folder, flushed to disk and
  renamed onto its name, so a full disk or a kill mid-write leaves the previous file as it was
  and never a truncated one beside it;
- **checksummed**: ``<checkpoint>.sha256`` is written beside it (also atomically) and checked on
  every read, so flipped or truncated bytes are refused by path instead of training on;
- **finite**: a state whose student weights hold NaN or inf is refused (``ValueError`` naming
  the tensor and the step), so ``last.ckpt`` and ``resume=auto`` keep pointing at the last good
  state;
- **weights-only reads**: :func:`read_checkpoint` loads with ``torch.load(weights_only=True)``:
  tensors and plain containers only, so a checkpoint carrying a pickle payload cannot run code.

``saopd-eval checkpoint=...`` and resuming read through :func:`read_checkpoint`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from saopd.io import atomic_write, file_sha256

__all__ = ["CHECKSUM_SUFFIX", "CheckpointError", "VerifiedCheckpointIO", "read_checkpoint",
           "verify_checkpoint"]

log = logging.getLogger(__name__)

#: The checksum file beside each checkpoint: ``<checkpoint><suffix>``, one hex sha256 line.
CHECKSUM_SUFFIX = ".sha256"


class CheckpointError(ValueError):
    """A checkpoint file that must not be loaded (corrupt, truncated, not a checkpoint, unsafe)."""


def _checksum_path(path: Path) -> Path:
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def verify_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The checkpoint file ``path`` resolves to (``last.ckpt`` may be a link), checked against
    its ``.sha256``; ``CheckpointError`` naming the file when the bytes differ. A checkpoint
    without a checksum file (written before checksums existed) is read with a warning."""
    given = Path(path)
    if not given.is_file():
        raise FileNotFoundError(f"checkpoint: no such file {given}")
    real = given.resolve()
    sidecar = _checksum_path(real)
    if not sidecar.is_file():
        log.warning("checkpoint %s has no %s file: its bytes are not verified", real,
                    CHECKSUM_SUFFIX)
        return real
    expected = sidecar.read_text().strip().split()[0] if sidecar.read_text().strip() else ""
    got = file_sha256(real)
    if got != expected:
        raise CheckpointError(
            f"checkpoint {given}{f' (-> {real})' if real != given.absolute() else ''} is "
            f"corrupt: its sha256 {got[:16]}... differs from {sidecar.name} "
            f"({expected[:16] or 'empty'}...); it was changed or cut after it was written. Use an "
            "older checkpoint of the run, or delete this one")
    return real


def read_checkpoint(path: str | os.PathLike[str],
                    map_location: Any = "cpu") -> dict[str, Any]:
    """A verified checkpoint's contents (:func:`verify_checkpoint`), loaded weights-only.

    Raises ``CheckpointError`` naming the file for a corrupt or truncated file, a file that is
    not a torch checkpoint, or one holding objects other than tensors and plain containers
    (a pickle payload is never executed).
    """
    real = verify_checkpoint(path)
    if not zipfile.is_zipfile(real):  # every torch.save file since torch 1.6 is a zip archive
        raise CheckpointError(f"checkpoint {path} cannot be read (truncated, or not a torch "
                              "checkpoint: it is not a zip archive)")
    try:
        state = torch.load(real, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"checkpoint {path} holds objects other than tensors and plain containers; it is "
            "refused, since loading it could run code (saopd checkpoints never hold such "
            "objects)") from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path} cannot be read (truncated, or not a torch "
                              f"checkpoint): {str(err).splitlines()[0][:200]}") from None
    if not isinstance(state, dict) or "state_dict" not in state:
        raise CheckpointError(f"checkpoint {path} is not a saopd training checkpoint (no "
                              "'state_dict')")
    return state


def _non_finite(checkpoint: dict[str, Any]) -> str | None:
    for name, value in checkpoint.get("state_dict", {}).items():
        if (isinstance(value, torch.Tensor) and value.is_floating_point()
                and not bool(torch.isfinite(value).all())):
            return name
    return None


class VerifiedCheckpointIO(TorchCheckpointIO):
    """Lightning's torch checkpoint I/O, made atomic, checksummed, finite and weights-only (see
    the module docstring)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("VerifiedCheckpointIO takes no storage_options")
        bad = _non_finite(checkpoint)
        if bad is not None:
            raise ValueError(
                f"not saving {path}: the weight {bad} is not finite at step "
                f"{checkpoint.get('global_step', '?')} (the run diverged); the previous "
                "checkpoint is kept")
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
        digest = hashlib.sha256()
        try:
            with open(tmp, "wb") as fh:
                torch.save(checkpoint, _HashingWriter(fh, digest.update))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        atomic_write(_checksum_path(target), [digest.hexdigest() + "\n"])

    def load_checkpoint(self, path: Any, map_location: Any = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        return read_checkpoint(path, map_location=map_location or "cpu")

    def remove_checkpoint(self, path: Any) -> None:
        super().remove_checkpoint(path)
        _checksum_path(Path(path)).unlink(missing_ok=True)


class _HashingWriter:
    """A writable file object that also feeds every written chunk to ``update``."""

    def __init__(self, fh: Any, update: Callable[[bytes], None]) -> None:
        self._fh = fh
        self._update = update

    def write(self, data: bytes) -> int:
        self._update(bytes(data))
        return self._fh.write(data)

    def flush(self) -> None:
        self._fh.flush()
