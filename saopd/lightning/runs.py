"""A training run's folder kept trustworthy: which checkpoint a resume continues, that the resumed
config is the run's, that one process trains a run at a time, and a checkpoint on preemption.

- :func:`find_resume`: ``resume=auto`` (the newest ``last.ckpt`` of the experiment), a run folder
  or a checkpoint file; the file is verified (checksum, weights-only) before training starts.
- :func:`run_folder`: where a resumed run writes: the checkpoint's run folder when the checkpoint
  lives in one (``<run>/checkpoints/<file>`` beside the run's record), else this job's own
  ``paths.output_dir`` (a checkpoint copied elsewhere never makes the run write beside it).
- :func:`check_resume_config`: the resolved config of a resumed run must equal the run's in
  every key that changes training (the seed included); differences are refused, naming the keys,
  unless listed in ``resume_changes`` (then recorded in the run folder and on the MLflow run).
  ``steps`` may grow without being listed (continuing a run longer is what resuming is for); the
  change is recorded all the same.
- :class:`RunLock`: ``<run>/.saopd.lock``, held while a process trains the run; a second
  process (two ``resume=auto`` at once) is refused instead of writing the same checkpoints.
- :class:`PreemptionCheckpoint`: on SIGTERM (what schedulers send before preemption) the step
  that just finished is saved as ``last.ckpt`` before Lightning stops the loop.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from filelock import FileLock, Timeout
from omegaconf import DictConfig, OmegaConf

from saopd.analysis.runs import is_hyperparameter
from saopd.config.train import TrainConfig
from saopd.io import write_json_atomic
from saopd.lightning.checkpoints import verify_checkpoint

__all__ = ["RESOLVED_CONFIG", "FiniteGuard", "NonFiniteError", "PreemptionCheckpoint",
           "RunBusyError", "RunLock", "check_resume_config", "find_resume", "run_folder",
           "schema_defaults", "training_config", "write_training_config"]

log = logging.getLogger(__name__)

#: The run's resolved training config (flattened ``key: value`` strings) in its folder.
RESOLVED_CONFIG = "saopd_config.json"


def find_resume(conf: TrainConfig) -> Path | None:
    """The checkpoint ``conf.resume`` names, verified, or None for a fresh run.

    ``auto``: the newest ``last.ckpt`` under ``<root>/outputs/<experiment_name>`` (None when
    there is none); a folder: its ``checkpoints/last.ckpt``; else a checkpoint file. Raises
    ``FileNotFoundError`` / ``CheckpointError`` naming the path.
    """
    if conf.resume in (None, "", "none"):
        return None
    if conf.resume == "auto":
        runs = Path(conf.paths.root) / "outputs" / conf.experiment_name
        found = sorted(runs.glob("*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
        if not found:
            log.info("resume=auto: no checkpoint under %s, starting fresh", runs)
            return None
        path = found[-1]
    else:
        path = Path(conf.resume)
        if path.is_dir():
            path = path / "checkpoints" / "last.ckpt"
        if not path.is_file():
            raise FileNotFoundError(f"resume: no checkpoint at {path}")
    verify_checkpoint(path)
    return path


def run_folder(ckpt: Path | None, output_dir: str | Path) -> Path:
    """The folder a run writes to: a resumed checkpoint's run folder when it is one (the
    checkpoint sits in ``<run>/checkpoints/`` beside the run's :data:`RESOLVED_CONFIG`), else
    ``output_dir`` (this job's)."""
    if ckpt is not None:
        run = Path(ckpt).absolute().parent.parent
        if Path(ckpt).absolute().parent.name == "checkpoints" and (run / RESOLVED_CONFIG).is_file():
            return run
    return Path(output_dir)


def training_config(cfg: DictConfig | Mapping[str, Any]) -> dict[str, str]:
    """The resolved config (a ``DictConfig`` or the validated config as a dict) as ``{dotted key:
    value as JSON text}``, only the keys that change training
    (:func:`saopd.analysis.runs.is_hyperparameter`, the seed included)."""
    plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    flat: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = json.dumps(node, sort_keys=True, default=str)

    walk(plain, "")
    return {k: v for k, v in flat.items()
            if k in ("seed", "step.seed") or is_hyperparameter(f"params.{k}")}


def schema_defaults(conf: Any) -> dict[str, str]:
    """``{dotted key: default as JSON text}`` of every field of the validated config ``conf``
    (a dataclass, walked through its dataclass-typed fields: each group by its own class, so
    ``rollout.*`` by the engine's), encoded as :func:`training_config` encodes values. Fields
    without a default, and the keys of plain mappings (filter, objective), are left out."""
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                walk(value, f"{prefix}{f.name}.")
                continue
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                continue
            if dataclasses.is_dataclass(default) or isinstance(default, Mapping):
                continue
            out[prefix + f.name] = json.dumps(default, sort_keys=True, default=str)

    walk(conf, "")
    return out


def write_training_config(run: Path, config: Mapping[str, str]) -> None:
    """Record the run's training config (:data:`RESOLVED_CONFIG`), atomically."""
    write_json_atomic(run / RESOLVED_CONFIG, dict(config))


def check_resume_config(run: Path, config: Mapping[str, str],
                        allowed: tuple[str, ...] = (),
                        defaults: Mapping[str, str] | None = None
                        ) -> dict[str, tuple[str, str]]:
    """Refuse a resume whose training config differs from the run's.

    Returns the differences that ``allowed`` (``resume_changes``) permits, ``{key: (run's,
    now)}``, to be recorded. Raises ``ValueError`` naming every other differing key with both
    values. A run folder without a recorded config (written before the check existed) is
    resumed with a warning. A key the run did not record (a setting added to saopd after the
    run started) is no difference when it is now at its default (``defaults``:
    :func:`schema_defaults`), which is how the run trained.
    """
    path = run / RESOLVED_CONFIG
    if not path.is_file():
        log.warning("resume: %s has no %s; the resumed config is not checked", run,
                    RESOLVED_CONFIG)
        return {}
    before = json.loads(path.read_text())
    defaults = defaults or {}
    newer = [k for k in config if k not in before and defaults.get(k) == config[k]]
    if newer:
        log.info("resume: %s has no record of %s (settings added since the run started); "
                 "they are at their defaults now", run, ", ".join(newer))
    before = {**before, **{k: config[k] for k in newer}}
    keys = sorted(set(before) | set(config))
    diff = {k: (before.get(k, "<absent>"), config.get(k, "<absent>")) for k in keys
            if before.get(k) != config.get(k)}
    refused = {k: v for k, v in diff.items() if k not in allowed}
    if refused:
        shown = "; ".join(f"{k}: {a} -> {b}" for k, (a, b) in refused.items())
        raise ValueError(
            f"the config differs from the run's in what changes training ({shown}). "
            f"Steps trained so would be credited to the run {run}. Start a new run, or list "
            "the keys you mean to change: resume_changes=[" + ",".join(refused) + "]")
    return {k: v for k, v in diff.items() if k in allowed}


class RunBusyError(OSError):
    """Another process is training the run (its lock is held)."""


class RunLock:
    """An exclusive lock on a run folder (``<run>/.saopd.lock``) while a process trains it.

    ``acquire`` raises :class:`RunBusyError` naming the folder when another process holds it (an
    OS file lock: a killed holder releases it at once)."""

    def __init__(self, run: Path) -> None:
        self.run = Path(run)
        self.lock = FileLock(str(self.run / ".saopd.lock"), timeout=0)

    def acquire(self) -> RunLock:
        self.run.mkdir(parents=True, exist_ok=True)
        try:
            self.lock.acquire()
        except Timeout:
            raise RunBusyError(
                f"run {self.run} is being trained by another process (lock "
                f"{self.lock.lock_file}); wait for it or stop it before resuming") from None
        return self

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class PreemptionCheckpoint(L.Callback):
    """On SIGTERM, save the step that just finished as ``<dirpath>/last.ckpt`` (Lightning then
    stops the loop with ``SIGTERMException``), so a preempted job resumes where it stopped."""

    def __init__(self, dirpath: Path) -> None:
        self.dirpath = Path(dirpath)
        self.saved: Path | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if getattr(trainer, "received_sigterm", False) and self.saved is None:
            self.saved = self.dirpath / "last.ckpt"
            trainer.save_checkpoint(self.saved)
            log.warning("SIGTERM: saved step %d to %s", trainer.global_step, self.saved)


class NonFiniteError(ValueError):
    """Training produced a NaN or inf (loss or weights); the run stops before saving it."""


class FiniteGuard(L.Callback):
    """Stop at the first step whose loss or updated student weights are not finite, naming the
    step and the quantity, before any checkpoint of that step is written (Lightning runs
    checkpoint callbacks after the others), so ``last.ckpt`` and ``resume=auto`` keep the last
    good state. Non-finite gradients show up here too: AdamW carries them into the weights."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step - 1  # the optimizer step that just ran
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor) and not bool(torch.isfinite(loss).all()):
            raise NonFiniteError(
                f"the loss is not finite ({float(loss.detach().float().reshape(-1)[0])}) at "
                f"step {step}: stopped before saving it (lower optim.lr, check the objective's "
                "hyperparameters or trainer.precision)")
        for name, param in pl_module.student.named_parameters():
            if param.is_floating_point() and not bool(torch.isfinite(param.detach()).all()):
                raise NonFiniteError(
                    f"the student weight {name} is not finite after step {step}: stopped "
                    "before saving it (the update diverged: lower optim.lr or check "
                    "trainer.precision)")
