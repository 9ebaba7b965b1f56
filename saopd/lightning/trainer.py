"""The Lightning ``Trainer`` of a run: strategy (one process, DDP, FSDP2), callbacks, settings.

:func:`build_trainer` turns ``conf.trainer`` (:class:`saopd.config.run.TrainerConfig`) into a
``lightning.Trainer`` with the run's callbacks; :func:`strategy` picks DDP or FSDP2
(``ModelParallelStrategy``, see :mod:`saopd.models.sharding`) or passes a Lightning strategy name
through; :func:`progress_callback` is the run's progress (``trainer.progress_bar``). Importing
this module filters the known noise of Lightning and torch out of a run's output
(:func:`quiet_known_noise`).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar

from saopd.config.train import TrainConfig
from saopd.data_parallel import num_training_processes
from saopd.lightning.callbacks import ProgressLines, RolloutCallback, TokenViewCallback
from saopd.lightning.checkpoints import CHECKSUM_SUFFIX, VerifiedCheckpointIO
from saopd.lightning.runs import FiniteGuard, PreemptionCheckpoint
from saopd.rollout.base import RolloutEngine, SamplingParams
from saopd.rollout.registry import holds_weights

__all__ = ["AdvertFilter", "RunCheckpoint", "build_trainer", "checkpoint_callback",
           "data_parallel_size", "progress_callback", "quiet_known_noise", "strategy"]

#: Lightning's loggers of ``rank_zero_info`` (the fabric's or the trainer's, whichever was set
#: last), where its tips are logged.
RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero",
                     "lightning.fabric.utilities.rank_zero")
#: Warnings that a run meets by design or from its libraries, each as (message regex, module
#: regex or "" for any, why it is not the user's business).
KNOWN_WARNINGS = (
    (r".*module\(s\) in eval mode.*", "", "the frozen teacher stays in eval mode"),
    (r".*pre-optimization state was saved.*", "",
     "checkpoints hold the weights after each step's update (manual optimization): what "
     "resuming needs"),
    (r".*your dataloader is not resumable.*", "",
     "a step's prompts are a function of the step: the loader needs no state to resume"),
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"lightning\.pytorch\.utilities\._pytree",
     "torch's deprecation met inside Lightning's own code (its _pytree helper)"),
)


class AdvertFilter(logging.Filter):
    """Drops Lightning's adverts for its cloud packages (the ``💡 Tip: ... install
    [litlogger]`` / ``[litmodels]`` lines every ``Trainer`` logs), nothing else."""

    PACKAGES = ("pypi.org/project/litlogger/", "pypi.org/project/litmodels/")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("💡 Tip:") and any(p in message for p in self.PACKAGES))


def quiet_known_noise() -> None:
    """Filter :data:`KNOWN_WARNINGS` and Lightning's adverts (:class:`AdvertFilter`, on the
    :data:`RANK_ZERO_LOGGERS`) out of the run's output; idempotent."""
    for message, module, _why in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, module=module)
    for name in RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, AdvertFilter) for f in logger.filters):
            logger.addFilter(AdvertFilter())


quiet_known_noise()


def data_parallel_size(conf: TrainConfig) -> int:
    """Training processes over all nodes for FSDP's mesh: ``trainer.devices`` x ``num_nodes``.

    Raises ``ValueError`` for ``devices: auto`` / ``-1`` off GPU (FSDP on CPU needs a count)
    and for a device list or count below 1.
    """
    t = conf.trainer
    devices = t.devices
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if devices in (-1, "auto") and not (t.accelerator in ("gpu", "cuda", "auto")
                                         and torch.cuda.is_available()):
        raise ValueError("trainer.strategy=fsdp on CPU needs trainer.devices as a number")
    if (isinstance(devices, (list, tuple)) and not devices) or (
            isinstance(devices, int) and devices == 0):
        raise ValueError(f"trainer.devices: no devices ({t.devices!r})")
    return num_training_processes(devices, t.num_nodes)


def strategy(conf: TrainConfig) -> Any:
    """The Lightning strategy of ``trainer.strategy`` (``ddp``, ``fsdp`` or a Lightning name)."""
    t = conf.trainer
    if t.strategy == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend=t.process_group_backend)
    if t.strategy == "fsdp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        # One file per checkpoint with the student only (see OPDModule.on_save_checkpoint), as
        # in single-process runs, so that resuming and saopd-eval read it the same way.
        return ModelParallelStrategy(data_parallel_size=data_parallel_size(conf),
                                     tensor_parallel_size=1, save_distributed_checkpoint=False,
                                     process_group_backend=t.process_group_backend)
    return t.strategy


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
    (:class:`~saopd.lightning.checkpoints.VerifiedCheckpointIO`); a moved run folder keeps
    replacing its own files (:class:`RunCheckpoint`)."""
    return RunCheckpoint(dirpath=out_dir / "checkpoints", filename="step_{step:06d}",
                         every_n_train_steps=conf.trainer.checkpoint_every_n_steps,
                         save_last="link",
                         save_top_k=-1 if conf.trainer.keep_all_checkpoints else 1,
                         auto_insert_metric_name=False)


def training_callbacks(conf: TrainConfig, engine: RolloutEngine,
                       out_dir: Path) -> list[L.Callback]:
    """The run's own callbacks, in order: rollouts before each step (:class:`RolloutCallback`),
    checkpoints, the finite guard, the preemption save, and the optional token views
    (``trainer.view_every_n_steps``). The evaluation is the caller's
    (:meth:`~saopd.lightning.callbacks.EvalCallback.from_config`): it reads the results."""
    sampling = SamplingParams(n=conf.rollout.n, temperature=conf.rollout.temperature,
                              top_p=conf.rollout.top_p, max_new_tokens=conf.rollout.max_new_tokens,
                              seed=conf.seed)
    callbacks: list[L.Callback] = [
        RolloutCallback(engine, sampling, sync_weights=holds_weights(engine),
                        async_steps=conf.rollout.async_steps),
        checkpoint_callback(conf, out_dir),
        FiniteGuard(temperature=conf.rollout.temperature),
        PreemptionCheckpoint(out_dir / "checkpoints"),
    ]
    if conf.trainer.view_every_n_steps:
        callbacks.append(TokenViewCallback(conf.trainer.view_every_n_steps, out_dir))
    return callbacks


def progress_callback(conf: TrainConfig) -> ProgressLines | None:
    """The run's progress lines (``trainer.progress_bar``, every ``trainer.progress_bar_every_s``
    seconds: :class:`~saopd.lightning.callbacks.ProgressLines`); None when it is off."""
    t = conf.trainer
    return ProgressLines(t.progress_bar_every_s) if t.progress_bar else None


def build_trainer(conf: TrainConfig, out_dir: Path, *, loggers: list[Any],
                  callbacks: list[L.Callback]) -> L.Trainer:
    """The run's ``Trainer``: ``conf.steps`` optimizer steps, one rollout batch each, logging
    every step, no validation loop; the prompt loader splits each step's batch by rank itself;
    checkpoints written atomically, checksummed and finite (:mod:`saopd.lightning.checkpoints`).
    Under SLURM, Lightning's own requeue on ``SIGUSR1`` is off: saopd's cluster launchers save
    and requeue a preempted job (``hydra_plugins.saopd_launchers``). Progress: the
    ``ProgressBar`` among ``callbacks``, else :func:`progress_callback`'s, else none (never
    Lightning's redrawn bar)."""
    t = conf.trainer
    if not any(isinstance(c, ProgressBar) for c in callbacks):
        progress = progress_callback(conf)
        callbacks = [progress, *callbacks] if progress is not None else callbacks
    plugins: list[Any] = [VerifiedCheckpointIO()]
    if SLURMEnvironment.detect():  # the launcher requeues; Lightning's would save elsewhere
        plugins.append(SLURMEnvironment(auto_requeue=False))
    return L.Trainer(
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes,
        strategy=strategy(conf), precision=t.precision, max_steps=conf.steps, logger=loggers,
        callbacks=callbacks, log_every_n_steps=1, num_sanity_val_steps=0, limit_val_batches=0,
        enable_progress_bar=any(isinstance(c, ProgressBar) for c in callbacks),
        enable_model_summary=False,
        default_root_dir=str(out_dir), use_distributed_sampler=False,
        plugins=plugins,
    )
