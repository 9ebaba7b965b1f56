"""Which checkpoint a resume continues, and as whose run: run folders and checkpoints that know
whose they are.

Identity. Every run has a ``run_uid`` (a random id given when it starts). The run folder's
record :data:`RUN_RECORD` holds it with the folder's absolute path, the config digest
(:func:`config_digest` of the training config) and the MLflow run the steps are logged to; every
checkpoint holds the same record and the training config itself under
:data:`CHECKPOINT_IDENTITY_KEY` (:class:`RunIdentityCallback`).

- :func:`find_resume`: ``resume=auto`` (this job's own folder's ``last.ckpt``, else the newest of
  the experiment), a run folder or a checkpoint file; the file is verified (checksum or stored
  digest, weights-only, finite) before training starts.
- :func:`plan_run`: where the run writes and under which identity. A checkpoint in
  ``<run>/checkpoints/`` that belongs to that run (its ``run_uid``, or one the folder was copied
  from) continues it: in place; after ``mv`` (the recorded path is gone) as the same run, the
  record updated; from a copy (the recorded folder still holds the same run) as a **new** run
  with a new ``run_uid`` and a new MLflow run, tagged with the run it was copied from, so a copy
  never logs into the original's MLflow run. A checkpoint of another run behind a folder's
  ``last.ckpt`` is refused unless the checkpoint file is named (``resume=<file>``); a named
  checkpoint outside its own run folder starts a new run in this job's ``paths.output_dir``,
  initialised from it and tagged likewise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import uuid
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Literal

import lightning as L

from saopd.config.train import TrainConfig
from saopd.io import write_json_atomic
from saopd.runs.checkpoints import read_checkpoint
from saopd.runs.folder import (
    RESOLVED_CONFIG,
    RunLock,
    check_resume_config,
    record_resume_changes,
    schema_defaults,
    write_training_config,
)

__all__ = ["CHECKPOINT_IDENTITY_KEY", "RUN_RECORD", "RunIdentity", "RunIdentityCallback",
           "RunPlan", "claimed_by", "config_digest", "find_resume", "open_run_folder",
           "plan_run", "read_run_record", "resume_changes", "write_run_record"]

log = logging.getLogger(__name__)

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
    read and verified (:func:`saopd.runs.checkpoints.read_checkpoint`, tensors mapped, not
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
    log.info("resume (%s): %s at step %s, in %s", plan.how, plan.checkpoint, plan.step,
             plan.folder)
    return plan


def resume_changes(plan: RunPlan, conf: TrainConfig,
                   config: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """What a resume changes on purpose (``conf.resume_changes``, and ``steps``): ``{key:
    (recorded, now)}``; ``{}`` for a fresh run. ``ValueError`` names any other difference from
    the config that trained the checkpoint (:func:`~saopd.runs.folder.check_resume_config`)."""
    if plan.checkpoint is None:
        return {}
    return check_resume_config(plan.recorded_config, config, (*conf.resume_changes, "steps"),
                               schema_defaults(conf), source=plan.config_source)


def open_run_folder(plan: RunPlan, config: Mapping[str, str],
                    changes: Mapping[str, tuple[str, str]], *, writer: bool) -> ExitStack:
    """Make the run folder and, in the process that writes it (``writer``: global rank 0),
    lock it (:class:`~saopd.runs.folder.RunLock`: one trainer per run) and write its
    records: the training config (``config``) when the run is new, a copy, started from a
    checkpoint, changed on purpose (``changes``) or has none yet; the identity record
    :data:`RUN_RECORD` with the config's digest; the changes. Returns what releases the lock
    (use it as a context manager). ``OSError`` (:class:`~saopd.runs.folder.RunBusyError`
    for a folder another process trains) or a failed write: nothing is left locked."""
    folder = plan.folder
    folder.mkdir(parents=True, exist_ok=True)
    held = ExitStack()
    if not writer:
        return held
    held.callback(RunLock(folder).acquire().release)
    try:
        if plan.how in ("new", "copied", "from_checkpoint") or changes \
                or not (folder / RESOLVED_CONFIG).is_file():
            write_training_config(folder, config)
        plan.identity.config_sha256 = config_digest(config)
        write_run_record(folder, plan.identity)
        if changes:
            record_resume_changes(folder, changes)
    except BaseException:
        held.close()
        raise
    return held


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
