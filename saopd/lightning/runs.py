"""A training run's folder kept trustworthy: which checkpoint a resume continues, that it is the
run's own and the resumed config is the one that trained it, that a copied or moved folder is
told apart from the original, that one process trains a run at a time, and a checkpoint on
preemption.

Identity. Every run has a ``run_uid`` (a random id given when it starts). The run folder's
record :data:`RUN_RECORD` holds it with the folder's absolute path, the config digest
(:func:`config_digest` of the training config) and the MLflow run the steps are logged to; every
checkpoint holds the same record and the training config itself under
:data:`CHECKPOINT_IDENTITY_KEY` (:class:`RunIdentityCallback`).

- :func:`find_resume`: ``resume=auto`` (the newest ``last.ckpt`` of the experiment), a run folder
  or a checkpoint file; the file is verified (checksum or stored digest, weights-only, finite)
  before training starts.
- :func:`plan_run`: where the run writes and under which identity. A checkpoint in
  ``<run>/checkpoints/`` that belongs to that run (its ``run_uid``, or one the folder was copied
  from) continues it: in place; after ``mv`` (the recorded path is gone) as the same run, the
  record updated; from a copy (the recorded folder still holds the same run) as a **new** run
  with a new ``run_uid`` and a new MLflow run, tagged with the run it was copied from, so a copy
  never logs into the original's MLflow run. A checkpoint of another run behind a folder's
  ``last.ckpt`` is refused unless the checkpoint file is named (``resume=<file>``); a named
  checkpoint outside its own run folder starts a new run in this job's ``paths.output_dir``,
  initialised from it and tagged likewise.
- :func:`check_resume_config`: the resolved config of a resumed run must equal the config that
  trained the checkpoint (recorded inside it; the folder's :data:`RESOLVED_CONFIG` for older
  checkpoints) in every key that changes training (the seed included); differences are refused,
  naming the keys, unless listed in ``resume_changes`` (then recorded in the run folder and on
  the MLflow run). ``steps`` may grow without being listed (continuing a run longer is what
  resuming is for); the change is recorded all the same.
- :class:`RunLock`: ``<run>/.saopd.lock``, held while a process trains the run; a second
  process (two ``resume=auto`` at once) is refused instead of writing the same checkpoints.
- :class:`PreemptionCheckpoint`: on SIGTERM (what schedulers send before preemption) the step
  that just finished is saved as ``last.ckpt`` before Lightning stops the loop.
- :class:`FiniteGuard`: a step whose loss or weights are not finite, or whose weights give
  non-finite next-token probabilities (huge but finite weights), stops the run before it is
  saved.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from filelock import FileLock, Timeout
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from saopd.analysis.runs import is_hyperparameter
from saopd.config.train import TrainConfig
from saopd.filters.distributed import world_size
from saopd.io import write_json_atomic
from saopd.lightning.checkpoints import read_checkpoint

__all__ = ["ACTIVATION_LIMIT", "CHECKPOINT_IDENTITY_KEY", "RESOLVED_CONFIG", "RUN_RECORD",
           "FiniteGuard", "NonFiniteError", "PreemptionCheckpoint", "RunBusyError", "RunIdentity",
           "RunIdentityCallback", "RunLock", "RunPlan", "check_resume_config", "claimed_by",
           "config_digest", "find_resume", "plan_run", "preemption_requested", "read_run_record",
           "request_preemption", "schema_defaults", "training_config", "write_run_record",
           "write_training_config"]

log = logging.getLogger(__name__)

#: The run's resolved training config (flattened ``key: value`` strings) in its folder.
RESOLVED_CONFIG = "saopd_config.json"
#: The run folder's identity record (:class:`RunIdentity` as JSON).
RUN_RECORD = "saopd_run.json"
#: The checkpoint key holding the run's identity and training config.
CHECKPOINT_IDENTITY_KEY = "saopd_run"


def find_resume(conf: TrainConfig, *, own_folder_only: bool = False) -> Path | None:
    """The checkpoint ``conf.resume`` names, verified, or None for a fresh run.

    ``auto``: this job's own folder's ``last.ckpt`` (``paths.output_dir``: a requeued cluster
    job, or a run started again in its folder), else the newest ``last.ckpt`` under
    ``<root>/outputs/<experiment_name>`` (None when there is none; never with
    ``own_folder_only``, as in a sweep job, where another run's would be wrong); a folder: its
    ``checkpoints/last.ckpt``; else a checkpoint file. The file is
    read and verified (:func:`saopd.lightning.checkpoints.read_checkpoint`, tensors mapped, not
    loaded). Raises ``FileNotFoundError`` / ``CheckpointError`` naming the path (a dangling
    ``last.ckpt`` names the file it pointed to).
    """
    path = _resume_path(conf, own_folder_only)
    if path is not None:
        read_checkpoint(path, mmap=True)  # FileNotFoundError / CheckpointError naming the path
    return path


def _resume_path(conf: TrainConfig, own_folder_only: bool) -> Path | None:
    """The checkpoint file ``conf.resume`` names (:func:`find_resume`), not yet read."""
    if conf.resume in (None, "", "none"):
        return None
    if conf.resume == "auto":
        own = Path(conf.paths.output_dir) / "checkpoints" / "last.ckpt"
        runs = Path(conf.paths.root) / "outputs" / conf.experiment_name
        if own.is_symlink() or own.exists():
            found = [own]
        elif own_folder_only:
            found = []
        else:
            found = sorted(runs.glob("*/checkpoints/last.ckpt"), key=lambda p: p.lstat().st_mtime)
        if not found:
            log.info("resume=auto: no checkpoint under %s, starting fresh", runs)
            return None
        path = found[-1]
    else:
        path = Path(conf.resume)
        if path.is_dir():
            path = path / "checkpoints" / "last.ckpt"
    return path


def config_digest(config: Mapping[str, str]) -> str:
    """sha256 of a training config (:func:`training_config`), independent of key order."""
    return hashlib.sha256(json.dumps(dict(config), sort_keys=True).encode()).hexdigest()


@dataclasses.dataclass
class RunIdentity:
    """Whose a run folder and its checkpoints are.

    Attributes:
        run_uid: the run's own id, given when it starts (a copy gets a new one).
        folder: the run folder's absolute path when the record was last written.
        config_sha256: :func:`config_digest` of the run's training config.
        run_id: the MLflow run its steps are logged to (None without MLflow).
        tracking_uri, mlflow_experiment: where that MLflow run is.
        lineage: the ``run_uid`` of the runs this one continues (a copy's original, ...):
            their checkpoints are the run's own.
        copied_from: for a copy, or a run started from another run's checkpoint: that run's
            ``run_uid``, ``run_id``, ``folder`` (and the ``checkpoint`` file).
    """

    run_uid: str
    folder: str
    config_sha256: str = ""
    run_id: str | None = None
    tracking_uri: str | None = None
    mlflow_experiment: str | None = None
    lineage: list[str] = dataclasses.field(default_factory=list)
    copied_from: dict[str, Any] | None = None

    @classmethod
    def new(cls, folder: Path, config: Mapping[str, str]) -> RunIdentity:
        """A fresh run's identity."""
        return cls(run_uid=uuid.uuid4().hex, folder=str(Path(folder).absolute()),
                   config_sha256=config_digest(config))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunIdentity:
        """From a record or a checkpoint's identity (unknown keys ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @property
    def uids(self) -> set[str]:
        """The run ids whose checkpoints are this run's own."""
        return {self.run_uid, *self.lineage}

    def to_dict(self) -> dict[str, Any]:
        """As JSON-ready data."""
        return dataclasses.asdict(self)


def read_run_record(folder: Path) -> RunIdentity | None:
    """The folder's :data:`RUN_RECORD`, None when it has none or one without a ``run_uid``
    (written before identities existed)."""
    path = Path(folder) / RUN_RECORD
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return RunIdentity.from_dict(data) if data.get("run_uid") else None


def write_run_record(folder: Path, identity: RunIdentity) -> None:
    """Write the folder's :data:`RUN_RECORD`, atomically."""
    write_json_atomic(Path(folder) / RUN_RECORD, identity.to_dict())


def claimed_by(folder: str | Path | None, run_uid: str, here: Path) -> Path | None:
    """``folder`` when it is another folder than ``here`` that still holds run ``run_uid`` (so
    ``here`` is a copy of it), else None."""
    if not folder:
        return None
    other = Path(folder)
    if other.absolute() == here.absolute() or not other.is_dir():
        return None
    try:
        if other.resolve() == here.resolve():
            return None
        record = read_run_record(other)
    except (OSError, ValueError):
        return None
    return other if record is not None and record.run_uid == run_uid else None


@dataclasses.dataclass
class RunPlan:
    """Where and as whom a run trains (:func:`plan_run`).

    Attributes:
        checkpoint: the checkpoint it resumes from (None: a fresh run).
        folder: the run folder it writes to.
        identity: its identity from now on (written to the folder and into its checkpoints).
        how: ``new``; ``resume`` (in place); ``moved`` (same run, the folder was moved);
            ``copied`` (a copy of a run folder: a new run); ``from_checkpoint`` (a checkpoint
            outside its run folder, or another run's named explicitly: a new run); ``legacy``
            (a folder or checkpoint written before identities: continued unchecked).
        recorded_config: the training config that trained the checkpoint (None: unknown).
        config_source: where ``recorded_config`` was read (for messages).
        step: the checkpoint's step (None: a fresh run).
    """

    checkpoint: Path | None
    folder: Path
    identity: RunIdentity
    how: Literal["new", "resume", "moved", "copied", "from_checkpoint", "legacy"]
    recorded_config: dict[str, str] | None = None
    config_source: str = ""
    step: int | None = None

    @property
    def continues_mlflow_run(self) -> bool:
        """Whether the run's steps go on in the MLflow run its record names."""
        return self.how in ("resume", "moved", "legacy") and self.identity.run_id is not None

    def as_copy(self, original: str) -> None:
        """Turn this plan into a copy's: a new ``run_uid`` and no MLflow run, the run it was
        copied from (``original``: that run's folder) recorded."""
        old = self.identity
        self.identity = dataclasses.replace(
            old, run_uid=uuid.uuid4().hex, run_id=None, lineage=[*old.lineage, old.run_uid],
            copied_from={"run_uid": old.run_uid, "run_id": old.run_id, "folder": original})
        self.how = "copied"


def _checkpoint_home(ckpt: Path) -> Path | None:
    """``<run>`` when ``ckpt`` sits in ``<run>/checkpoints/`` beside a run record or config."""
    path = Path(ckpt).absolute()
    run = path.parent.parent
    if path.parent.name == "checkpoints" and (
            (run / RUN_RECORD).is_file() or (run / RESOLVED_CONFIG).is_file()):
        return run
    return None


def _recorded_config(folder: Path | None) -> dict[str, str] | None:
    path = None if folder is None else folder / RESOLVED_CONFIG
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def plan_run(conf: TrainConfig, config: Mapping[str, str], *,
             own_folder_only: bool = False) -> RunPlan:
    """Where and as whom this run trains (see the module docstring): the checkpoint of
    ``conf.resume`` (:func:`find_resume`), its run folder and identity, the config that trained
    it and its step. ``config``: this run's training config (:func:`training_config`);
    ``own_folder_only``: see :func:`find_resume`.

    Raises ``ValueError`` for another run's checkpoint behind a folder's ``last.ckpt`` (not
    named as a file), and what :func:`find_resume` raises.
    """
    output_dir = Path(conf.paths.output_dir).absolute()
    ckpt = _resume_path(conf, own_folder_only)
    if ckpt is None:
        return RunPlan(None, output_dir, RunIdentity.new(output_dir, config), "new")
    state = read_checkpoint(ckpt, mmap=True)  # verified once here, once when Lightning loads it
    plan = _plan_resume(conf, config, ckpt, state)
    plan.step = int(state.get("global_step", 0))
    return plan


def _plan_resume(conf: TrainConfig, config: Mapping[str, str], ckpt: Path,
                 state: Mapping[str, Any]) -> RunPlan:
    """:func:`plan_run` for a resume from ``ckpt`` (its contents ``state``)."""
    output_dir = Path(conf.paths.output_dir).absolute()
    stored = state.get(CHECKPOINT_IDENTITY_KEY)
    theirs = RunIdentity.from_dict(stored) if isinstance(stored, Mapping) else None
    their_config = (dict(stored["config"]) if isinstance(stored, Mapping)
                    and isinstance(stored.get("config"), Mapping) else None)
    home = _checkpoint_home(ckpt)
    record = read_run_record(home) if home is not None else None
    named = conf.resume not in ("auto",) and not Path(conf.resume).is_dir()

    def started_from_it() -> RunPlan:
        identity = RunIdentity.new(output_dir, config)
        if theirs is not None:
            identity.copied_from = {"run_uid": theirs.run_uid, "run_id": theirs.run_id,
                                    "folder": theirs.folder, "checkpoint": str(ckpt.absolute())}
        recorded = their_config if their_config is not None else _recorded_config(home)
        return RunPlan(ckpt, output_dir, identity, "from_checkpoint", recorded,
                       f"checkpoint {ckpt}")

    if home is None:
        return started_from_it()
    if theirs is None:  # a checkpoint written before identities: continued unchecked
        log.warning("resume: %s has no run identity (an older checkpoint); it is continued "
                    "without checking whose it is", ckpt)
        raw = json.loads((home / RUN_RECORD).read_text()) if (home / RUN_RECORD).is_file() \
            else {}
        identity = record or dataclasses.replace(
            RunIdentity.new(home, config), run_id=raw.get("run_id"),
            tracking_uri=raw.get("tracking_uri"), mlflow_experiment=raw.get("mlflow_experiment"))
        return RunPlan(ckpt, home, identity, "legacy", _recorded_config(home), f"run {home}")
    owner = record or theirs  # a folder that lost its record: the checkpoint's stands in
    if theirs.run_uid not in owner.uids:
        if not named:
            raise ValueError(
                f"{ckpt} is a checkpoint of another run (run {theirs.run_uid}, MLflow run "
                f"{theirs.run_id}, trained in {theirs.folder}), not of {home} (run "
                f"{owner.run_uid}): it was put there from elsewhere. To start a new run from "
                f"it, name the file: resume={ckpt.absolute()}")
        return started_from_it()
    here = home.absolute()
    plan = RunPlan(ckpt, home, dataclasses.replace(owner, folder=str(here)), "resume",
                   their_config if their_config is not None else _recorded_config(home),
                   f"checkpoint {ckpt}")
    if Path(owner.folder) != here:
        original = claimed_by(owner.folder, owner.run_uid, here)
        if original is not None:
            plan.as_copy(str(original))
            log.warning("resume: %s is a copy of run folder %s: it continues as a new run "
                        "(copied_from is recorded)", here, original)
        else:
            plan.how = "moved"
            log.info("resume: run folder moved from %s to %s", owner.folder, here)
    return plan


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


def check_resume_config(recorded: Mapping[str, str] | None, config: Mapping[str, str],
                        allowed: tuple[str, ...] = (),
                        defaults: Mapping[str, str] | None = None, *,
                        source: str = "the run") -> dict[str, tuple[str, str]]:
    """Refuse a resume whose training config differs from the one that trained the checkpoint.

    ``recorded``: that config (:attr:`RunPlan.recorded_config`), ``source`` where it was read
    (for the message). Returns the differences that ``allowed`` (``resume_changes``) permits,
    ``{key: (recorded, now)}``, to be recorded. Raises ``ValueError`` naming every other
    differing key with both values. Without a recorded config (a run written before the check
    existed) the resume is allowed with a warning. A key the run did not record (a setting
    added to saopd after the run started) is no difference when it is now at its default
    (``defaults``: :func:`schema_defaults`), which is how the run trained.
    """
    if recorded is None:
        log.warning("resume: %s has no recorded config; the resumed config is not checked",
                    source)
        return {}
    before = dict(recorded)
    defaults = defaults or {}
    newer = [k for k in config if k not in before and defaults.get(k) == config[k]]
    if newer:
        log.info("resume: %s has no record of %s (settings added since the run started); "
                 "they are at their defaults now", source, ", ".join(newer))
    before = {**before, **{k: config[k] for k in newer}}
    keys = sorted(set(before) | set(config))
    diff = {k: (before.get(k, "<absent>"), config.get(k, "<absent>")) for k in keys
            if before.get(k) != config.get(k)}
    refused = {k: v for k, v in diff.items() if k not in allowed}
    if refused:
        shown = "; ".join(f"{k}: {a} -> {b}" for k, (a, b) in refused.items())
        raise ValueError(
            f"the config differs from the one that trained {source} in what changes training "
            f"({shown}). Steps trained so would be credited to that run. Start a new run, or "
            "list the keys you mean to change: resume_changes=[" + ",".join(refused) + "]")
    return {k: v for k, v in diff.items() if k in allowed}


class RunIdentityCallback(L.Callback):
    """Writes the run's identity and training config into every checkpoint
    (:data:`CHECKPOINT_IDENTITY_KEY`). ``identity`` is read at each save, so the MLflow run id
    filled in after the logger starts is included."""

    def __init__(self, identity: RunIdentity, config: Mapping[str, str]) -> None:
        self.identity = identity
        self.config = dict(config)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: Any,
                           checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_IDENTITY_KEY] = {**self.identity.to_dict(),
                                               "config": dict(self.config)}


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


_PREEMPTED = threading.Event()


def request_preemption() -> None:
    """Mark this process's run preempted: :class:`PreemptionCheckpoint` saves the step in
    progress when it ends and stops the loop (a cluster launcher's signal handler calls this,
    e.g. ``hydra_plugins.saopd_launchers``)."""
    _PREEMPTED.set()


def preemption_requested() -> bool:
    """Whether :func:`request_preemption` was called in this process."""
    return _PREEMPTED.is_set()


class PreemptionCheckpoint(L.Callback):
    """On SIGTERM (what schedulers send before preemption) or :func:`request_preemption`, save
    the step that just finished as ``<dirpath>/last.ckpt`` and stop the loop (Lightning's
    ``SIGTERMException``), so a preempted job resumes where it stopped."""

    def __init__(self, dirpath: Path) -> None:
        self.dirpath = Path(dirpath)
        self.saved: Path | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        sigterm = bool(getattr(trainer, "received_sigterm", False))
        if (sigterm or preemption_requested()) and self.saved is None:
            self.saved = self.dirpath / "last.ckpt"
            trainer.save_checkpoint(self.saved)
            log.warning("preempted: saved step %d to %s", trainer.global_step, self.saved)
            # Lightning stops the loop itself after a SIGTERM; a finished run just ends
            if not sigterm and trainer.global_step < (trainer.max_steps or 0):
                raise SIGTERMException


class NonFiniteError(ValueError):
    """Training produced a NaN or inf (loss or weights); the run stops before saving it."""


#: The largest activation a healthy forward may hold: normalisation layers square the hidden
#: states in float32 (HF's RMSNorm and LayerNorm upcast), and a value beyond sqrt(float32 max)
#: ~ 1.8e19 overflows there, so the next layers, and the sampler, get zeros or NaN.
ACTIVATION_LIMIT = float(torch.finfo(torch.float32).max) ** 0.5


class FiniteGuard(L.Callback):
    """Stop at the first step whose loss or updated student weights are not finite, or whose
    weights no longer give a sane forward, naming the step and the quantity, before any
    checkpoint of that step is written (Lightning runs checkpoint callbacks after the others),
    so ``last.ckpt`` and ``resume=auto`` keep the last good state. Non-finite gradients show up
    here too: AdamW carries them into the weights.

    The forward: huge but finite weights (``optim.lr=1e12``) pass the weight check and then
    break the next step's sampler (torch's ``multinomial`` on NaN probabilities). So after each
    step the student scores a probe (the first ``probe_tokens`` tokens of one of the step's
    responses): every hidden state must stay within :data:`ACTIVATION_LIMIT` and the
    probabilities the sampler would draw from, ``softmax(logits / temperature)``, must be
    finite. Every rank runs the probe (an FSDP forward is collective) and the verdict is summed
    over ranks.
    """

    def __init__(self, temperature: float | None = 1.0, probe_tokens: int = 16) -> None:
        self.temperature = temperature
        self.probe_tokens = probe_tokens
        self._probe: list[int] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        rollouts = getattr(pl_module, "pending_rollouts", None)
        found = next((r.response_ids for r in getattr(rollouts, "rollouts", [])
                      if r.response_ids), None)
        if found is None:
            eos = getattr(getattr(pl_module, "tokenizer", None), "eos_token_id", None)
            found = [int(eos) if isinstance(eos, int) else 0]
        self._probe = list(found[:self.probe_tokens])

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
        if not self._probe:
            return
        peak = self._probe_peak(pl_module)
        if not peak <= ACTIVATION_LIMIT:
            name, largest = _largest_weight(pl_module.student)
            raise NonFiniteError(
                f"the student's forward is broken after step {step}: its weights are finite "
                f"but huge (the largest, {name}, is {largest:.3g}) and its activations reach "
                f"{peak:.3g} (beyond {ACTIVATION_LIMIT:.2g}, where float32 overflows and the "
                "sampler gets NaN): stopped before saving it, so the run's last checkpoint is "
                "its last healthy step (the update diverged: lower optim.lr or check "
                "trainer.precision)")

    def _probe_peak(self, pl_module: Any) -> float:
        """The largest |activation| of the probe's forward over all ranks (inf when the
        sampler's probabilities are not finite)."""
        student = pl_module.student
        ids = torch.tensor([self._probe], dtype=torch.long, device=pl_module.device)
        was_training = student.training
        student.eval()
        try:
            with torch.no_grad():
                out = student(input_ids=ids, use_cache=False, output_hidden_states=True)
        finally:
            student.train(was_training)
        logits = out.logits.float()  # [1, T, V]
        scores = logits / self.temperature if self.temperature else logits
        peak = max([float(h.detach().float().abs().max()) for h in out.hidden_states or ()]
                   + [float(logits.abs().max())])
        if not bool(torch.isfinite(torch.softmax(scores, dim=-1)).all()):
            peak = float("inf")
        if math.isnan(peak):
            peak = float("inf")
        return peak if world_size() == 1 else _max_over_ranks(peak, pl_module.device)


def _max_over_ranks(value: float, device: Any) -> float:
    """The largest ``value`` of all ranks."""
    import torch.distributed as dist

    out = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out)


def _largest_weight(model: torch.nn.Module) -> tuple[str, float]:
    """The name and magnitude of the student's largest weight (this rank's shard)."""
    best = ("", 0.0)
    for name, param in model.named_parameters():
        if param.is_floating_point() and param.numel():
            value = float(param.detach().abs().max())
            if value > best[1]:
                best = (name, value)
    return best
