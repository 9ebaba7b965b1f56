"""Checkpoint files that are whole, verified and safe to load.

:class:`VerifiedCheckpointIO` is the Trainer's checkpoint I/O (``build_trainer`` installs it):

- **atomic**: a checkpoint is written to a temporary file in its own folder, flushed to disk and
  renamed onto its name, so a full disk or a kill mid-write leaves the previous file as it was
  and never a truncated one beside it;
- **checksummed twice**: ``<checkpoint>.sha256`` is written beside it (also atomically) and
  checked on every read, so flipped or truncated bytes are refused by path instead of training
  on; and a digest of the checkpoint's contents (every tensor's bytes, dtype and shape and every
  other value, :func:`content_digest`) is stored inside it under :data:`CONTENT_DIGEST_KEY` and
  checked after every load, so a checkpoint whose sidecar was lost (a plain ``cp``) is still
  verified, and an edited one (a weight changed and saved again) is refused. A checkpoint with
  neither (written before saopd stored digests, and copied without its sidecar) is refused:
  its bytes cannot be verified;
- **finite**: a state whose student weights hold NaN or inf is neither written (``ValueError``
  naming the tensor and the step, so ``last.ckpt`` and ``resume=auto`` keep pointing at the last
  good state) nor read;
- **a full disk named**: a write that fails (ENOSPC, EIO) raises an ``OSError`` naming the
  checkpoint's path, not torch's ``unexpected pos``; the previous checkpoint stays whole;
- **weights-only reads**: :func:`read_checkpoint` loads with ``torch.load(weights_only=True)``:
  tensors and plain containers only, so a checkpoint carrying a pickle payload cannot run code.

``saopd-eval checkpoint=...`` and resuming read through :func:`read_checkpoint`. The run's
checkpoint callback (:func:`checkpoint_callback`, a :class:`RunCheckpoint`) writes
``step_XXXXXX.ckpt`` and ``last.ckpt`` and keeps replacing its own files when the run folder
moves.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import uuid
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from saopd.config.train import TrainConfig
from saopd.io import atomic_write, file_sha256

__all__ = ["CHECKSUM_SUFFIX", "CONTENT_DIGEST_KEY", "CheckpointError", "RunCheckpoint",
           "VerifiedCheckpointIO", "checkpoint_callback", "checkpoint_step", "content_digest",
           "read_checkpoint", "verify_checkpoint"]

log = logging.getLogger(__name__)

#: The checksum file beside each checkpoint: ``<checkpoint><suffix>``, one hex sha256 line.
CHECKSUM_SUFFIX = ".sha256"

#: The key of a checkpoint that holds :func:`content_digest` of everything else in it.
CONTENT_DIGEST_KEY = "saopd_content_sha256"


class CheckpointError(ValueError):
    """A checkpoint file that must not be loaded (corrupt, truncated, not a checkpoint, unsafe)."""


def _checksum_path(path: Path) -> Path:
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def verify_checkpoint(path: str | os.PathLike[str]) -> tuple[Path, bool]:
    """The checkpoint file ``path`` resolves to (``last.ckpt`` may be a link) and whether its
    ``.sha256`` sidecar vouched for its bytes (False when there is no sidecar: the caller must
    verify it another way, :func:`read_checkpoint` does with the digest stored inside).

    Raises ``FileNotFoundError`` naming the path (a dangling link names its target) and
    ``CheckpointError`` when the bytes differ from the sidecar."""
    given = Path(path)
    if not given.is_file():
        if given.is_symlink():
            raise FileNotFoundError(
                f"{given} is a dangling link: the checkpoint it points to "
                f"({os.readlink(given)}) is gone")
        raise FileNotFoundError(f"no checkpoint at {given}")
    real = given.resolve()
    sidecar = _checksum_path(real)
    if not sidecar.is_file():
        return real, False
    text = sidecar.read_text().strip()
    expected = text.split()[0] if text else ""
    got = file_sha256(real)
    if got != expected and _contents_intact(real):
        raise CheckpointError(
            f"checkpoint {given}{f' (-> {real})' if real != given.absolute() else ''}: its "
            f"{sidecar.name} is wrong, not the checkpoint: the file's sha256 {got[:16]}... "
            f"differs from it ({expected[:16] or 'empty'}...), but its contents match the digest "
            "stored inside when it was written (a sidecar of another file, or edited). Rewrite "
            f"it: sha256sum {real} > {sidecar}")
    if got != expected:
        raise CheckpointError(
            f"checkpoint {given}{f' (-> {real})' if real != given.absolute() else ''} is "
            f"corrupt: its sha256 {got[:16]}... differs from {sidecar.name} "
            f"({expected[:16] or 'empty'}...); it was changed or cut after it was written. Use an "
            "older checkpoint of the run, or delete this one")
    return real, True


def _mapped_unverified(real: Path) -> dict[str, Any] | None:
    """Checkpoint file ``real`` loaded weights-only with its tensors mapped, not read, and not
    verified; None when it cannot be read as a checkpoint's dict."""
    if not zipfile.is_zipfile(real):
        return None
    try:
        state = torch.load(real, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def _contents_intact(real: Path) -> bool:
    """Whether checkpoint file ``real`` loads (weights only) and its contents match the digest
    stored inside it (False when it cannot be read or stores none)."""
    state = _mapped_unverified(real)
    stored = state.get(CONTENT_DIGEST_KEY) if state is not None else None
    return stored is not None and stored == content_digest(state)


def checkpoint_step(path: str | os.PathLike[str]) -> int | None:
    """The ``global_step`` recorded in checkpoint ``path`` (a link is followed), read without
    verifying the file or reading its tensors (for naming a saved step, e.g. at a SIGTERM);
    None when the file is missing, not a checkpoint or holds no step."""
    given = Path(path)
    state = _mapped_unverified(given.resolve()) if given.is_file() else None
    step = state.get("global_step") if state is not None else None
    return int(step) if isinstance(step, int) else None


def content_digest(checkpoint: Mapping[str, Any]) -> str:
    """sha256 of a checkpoint's contents but :data:`CONTENT_DIGEST_KEY`: every tensor's dtype,
    shape and bytes and every other value, walked in a fixed order (mapping keys sorted, their
    type included), so the same state gives the same digest before saving and after loading."""
    h = hashlib.sha256()

    def walk(node: Any, where: str) -> None:
        if isinstance(node, torch.Tensor):
            t = node.detach()
            h.update(f"{where}\0tensor {t.dtype} {tuple(t.shape)}\0".encode())
            if t.numel():
                h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        elif isinstance(node, Mapping):
            keys = sorted((k for k in node if where or k != CONTENT_DIGEST_KEY),
                          key=lambda k: (type(k).__name__, str(k)))
            h.update(f"{where}\0map {len(keys)}\0".encode())
            for key in keys:
                walk(node[key], f"{where}/{type(key).__name__}:{key}")
        elif isinstance(node, (list, tuple)):
            h.update(f"{where}\0seq {len(node)}\0".encode())
            for i, item in enumerate(node):
                walk(item, f"{where}/{i}")
        else:
            h.update(f"{where}\0{type(node).__name__} {node!r}\0".encode())

    walk(checkpoint, "")
    return h.hexdigest()


def read_checkpoint(path: str | os.PathLike[str], map_location: Any = "cpu", *,
                    mmap: bool = False) -> dict[str, Any]:
    """A verified checkpoint's contents, loaded weights-only.

    Verified: its bytes against the ``.sha256`` sidecar when there is one
    (:func:`verify_checkpoint`), and its contents against the digest stored inside
    (:data:`CONTENT_DIGEST_KEY`); a checkpoint with neither is refused, as is one whose student
    weights are not finite. ``mmap``: map the tensors instead of reading them into memory (for
    reading a checkpoint's records before training loads it).

    Raises ``CheckpointError`` naming the file for a corrupt or truncated file, a file that is
    not a torch checkpoint, one holding objects other than tensors and plain containers (a
    pickle payload is never executed), an unverifiable or a non-finite one.
    """
    real, vouched = verify_checkpoint(path)
    if not zipfile.is_zipfile(real):  # every torch.save file since torch 1.6 is a zip archive
        raise CheckpointError(f"checkpoint {path} cannot be read (truncated, or not a torch "
                              "checkpoint: it is not a zip archive)")
    try:
        state = torch.load(real, map_location=map_location, weights_only=True, mmap=mmap)
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
    stored = state.get(CONTENT_DIGEST_KEY)
    if stored is None and not vouched:
        raise CheckpointError(
            f"checkpoint {path} cannot be verified: it has no {CHECKSUM_SUFFIX} file beside it "
            "and no content digest inside (written by an older saopd, then copied without its "
            f"sidecar). If you trust it, record its checksum: sha256sum {real} > "
            f"{_checksum_path(real)}")
    if stored is not None and stored != content_digest(state):
        raise CheckpointError(
            f"checkpoint {path} is corrupt: its contents differ from the digest stored inside "
            "it when it was written (a tensor or value was changed afterwards). Use an older "
            "checkpoint of the run, or delete this one")
    bad = _non_finite(state)
    if bad is not None:
        raise CheckpointError(f"checkpoint {path} holds a weight that is not finite ({bad}); "
                              "it is refused")
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
        checkpoint = {**checkpoint, CONTENT_DIGEST_KEY: content_digest(checkpoint)}
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
        digest = hashlib.sha256()
        writer: _HashingWriter | None = None
        try:
            with open(tmp, "wb") as fh:
                writer = _HashingWriter(fh, digest.update)
                torch.save(checkpoint, writer)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
            atomic_write(_checksum_path(target), [digest.hexdigest() + "\n"])
        except BaseException as err:
            tmp.unlink(missing_ok=True)
            # torch's zip writer hides a failed write behind "unexpected pos": say what failed
            cause = writer.error if writer is not None and writer.error else err
            if isinstance(cause, OSError):
                raise OSError(cause.errno, f"cannot write the checkpoint {target}: "
                              f"{cause.strerror or cause}") from None
            raise

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
        self.error: OSError | None = None  # the first failed write (torch's writer hides it)

    def write(self, data: bytes) -> int:
        self._update(bytes(data))
        try:
            return self._fh.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        try:
            self._fh.flush()
        except OSError as err:
            self.error = self.error or err
            raise


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` that keeps track of its files when the run folder moves.

    Lightning restores the paths of the last and the kept checkpoints only when the folder is
    where it was (``dirpath`` unchanged); after ``mv`` it forgets them, so ``last.ckpt`` was
    never replaced (a ``last-v1.ckpt`` beside it, and the next resume restored the old step) and
    superseded ``step_*.ckpt`` files stayed on disk. Here the recorded paths under the old folder
    are mapped to the same files under the new one. The version counter is off: a file of the
    same name is replaced, never versioned."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("enable_version_counter", False)
        super().__init__(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        old, new = state_dict.get("dirpath"), self.dirpath
        if old and new and old != new:
            def moved(path: Any) -> Any:
                if not path:
                    return path
                try:
                    return str(Path(new) / Path(path).relative_to(old))
                except ValueError:  # not under the old folder: left as it is
                    return path

            state_dict = {**state_dict, "dirpath": new,
                          **{key: moved(state_dict.get(key)) for key in
                             ("best_model_path", "kth_best_model_path", "last_model_path")},
                          "best_k_models": {moved(k): v for k, v in
                                            (state_dict.get("best_k_models") or {}).items()}}
        super().load_state_dict(state_dict)

    @staticmethod
    def _link_checkpoint(trainer: L.Trainer, filepath: str, linkpath: str) -> None:
        """Lightning's link, and the sidecar of a file it replaces removed (``last.ckpt`` is a
        file after a preemption; the link's checksum is its target's)."""
        if trainer.is_global_zero and Path(linkpath).is_file() \
                and not Path(linkpath).is_symlink():
            Path(linkpath + CHECKSUM_SUFFIX).unlink(missing_ok=True)
        ModelCheckpoint._link_checkpoint(trainer, filepath, linkpath)


def checkpoint_callback(conf: TrainConfig, out_dir: Path) -> ModelCheckpoint:
    """``step_XXXXXX.ckpt`` every ``trainer.checkpoint_every_n_steps`` and ``last.ckpt``, a link
    to the newest one (one copy on disk, not two), each with its ``.sha256``
    (:class:`~saopd.runs.checkpoints.VerifiedCheckpointIO`); a moved run folder keeps
    replacing its own files (:class:`RunCheckpoint`)."""
    return RunCheckpoint(dirpath=out_dir / "checkpoints", filename="step_{step:06d}",
                         every_n_train_steps=conf.trainer.checkpoint_every_n_steps,
                         save_last="link",
                         save_top_k=-1 if conf.trainer.keep_all_checkpoints else 1,
                         auto_insert_metric_name=False)
