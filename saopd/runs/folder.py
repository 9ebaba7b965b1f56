"""A training run's folder kept trustworthy: that the resumed config is the one that trained the
checkpoint, that one process trains a run at a time, a checkpoint on preemption, and no step of
a diverged update saved. Which checkpoint a resume continues, and as whose run:
:mod:`saopd.runs.resume`.

- :func:`check_resume_config`: the resolved config of a resumed run must equal the config that
  trained the checkpoint (recorded inside it; the folder's :data:`RESOLVED_CONFIG` for older
  checkpoints) in every key that changes training (the seed included); differences are refused,
  naming the keys, unless listed in ``resume_changes`` (then recorded in the run folder and on
  the MLflow run). ``steps`` may grow without being listed (continuing a run longer is what
  resuming is for); the change is recorded all the same.
- :class:`RunLock`: ``<run>/.saopd.lock``, held while a process trains the run; a second
  process (two ``resume=auto`` at once) is refused instead of writing the same checkpoints.
- :class:`PreemptionCheckpoint`: on SIGTERM (what schedulers send before preemption) or
  :func:`request_preemption` (a cluster launcher's signal), the step that just finished is saved
  as ``last.ckpt`` and the loop stops.
- :class:`FiniteGuard`: a step whose loss or weights are not finite, or whose weights give
  non-finite next-token probabilities (huge but finite weights), stops the run before it is
  saved.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from filelock import FileLock, Timeout
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from saopd.analysis.collect import is_hyperparameter
from saopd.data_parallel import all_reduce_max
from saopd.io import write_json_atomic

__all__ = ["ACTIVATION_LIMIT", "RESOLVED_CONFIG", "FiniteGuard", "NonFiniteError",
           "PreemptionCheckpoint", "RunBusyError", "RunLock", "check_resume_config",
           "preemption_requested", "request_preemption", "schema_defaults", "training_config",
           "write_training_config"]

log = logging.getLogger(__name__)

#: The run's resolved training config (flattened ``key: value`` strings) in its folder.
RESOLVED_CONFIG = "saopd_config.json"
def training_config(cfg: DictConfig | Mapping[str, Any]) -> dict[str, str]:
    """The resolved config (a ``DictConfig`` or the validated config as a dict) as ``{dotted key:
    value as JSON text}``, only the keys that change training
    (:func:`saopd.analysis.collect.is_hyperparameter`, the seed included)."""
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


def record_resume_changes(run: Path, changes: Mapping[str, tuple[str, str]]) -> None:
    """Append the keys a resume changed on purpose (``resume_changes``: ``{key: (recorded,
    now)}``) to the run's ``saopd_resume_changes.jsonl``."""
    record = run / "saopd_resume_changes.jsonl"
    with record.open("a") as fh:
        fh.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                             "changes": {k: {"run": a, "now": b}
                                         for k, (a, b) in changes.items()}}) + "\n")
    if set(changes) == {"steps"}:  # training on for longer is what a resume is for
        log.info("resume: steps %s -> %s (recorded in %s)", *changes["steps"], record)
    else:
        log.warning("resume changes %s on purpose (recorded in %s)", ", ".join(changes),
                    record)


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
            # the whole state (optimizer too), as the periodic checkpoints; said explicitly, else
            # Lightning logs "`weights_only` was not set, defaulting to `False`", which reads
            # like an unsafe load (checkpoints are always read weights-only)
            trainer.save_checkpoint(self.saved, weights_only=False)
            log.warning("preempted: saved step %d to %s", trainer.global_step, self.saved)
            # Lightning stops the loop itself after a SIGTERM; a finished run just ends
            if not sigterm and trainer.global_step < (trainer.max_steps or 0):
                raise SIGTERMException

    def on_exception(self, trainer: L.Trainer, pl_module: Any, exception: BaseException) -> None:
        """A SIGTERM that came after this callback's turn in the step's hooks: Lightning stops
        the loop once the step is done, so the state is whole; save it."""
        if isinstance(exception, SIGTERMException) and self.saved is None \
                and trainer.global_step > 0:
            self.saved = self.dirpath / "last.ckpt"
            trainer.save_checkpoint(self.saved, weights_only=False)
            log.warning("preempted: saved step %d to %s", trainer.global_step, self.saved)


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
        rollouts = getattr(batch, "rollouts", None)  # attached by the RolloutCallback
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
        return float(all_reduce_max(torch.tensor(peak, dtype=torch.float64,
                                                 device=pl_module.device)))


def _largest_weight(model: torch.nn.Module) -> tuple[str, float]:
    """The name and magnitude of the student's largest weight (this rank's shard)."""
    best = ("", 0.0)
    for name, param in model.named_parameters():
        if param.is_floating_point() and param.numel():
            value = float(param.detach().abs().max())
            if value > best[1]:
                best = (name, value)
    return best
