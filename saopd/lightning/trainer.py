"""The Lightning ``Trainer`` of a run: strategy (one process, DDP, FSDP2), callbacks, settings.

:func:`build_trainer` turns ``conf.trainer`` (:class:`saopd.config.run.TrainerConfig`) into a
``lightning.Trainer`` with the run's callbacks; :func:`strategy` picks DDP or FSDP2
(``ModelParallelStrategy``, see :mod:`saopd.models.sharding`) or passes a Lightning strategy name
through; :func:`progress_callback` is the run's progress (``trainer.progress_bar``). Importing
this module filters the known noise of Lightning and torch out of a run's output
(:func:`saopd.runs.log.quiet_known_noise`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ProgressBar

from saopd.config.train import TrainConfig
from saopd.data_parallel import num_training_processes
from saopd.lightning.callbacks import ProgressLines, RolloutCallback, TokenViewCallback
from saopd.rollout.base import RolloutEngine, SamplingParams
from saopd.rollout.registry import holds_weights
from saopd.runs.checkpoints import VerifiedCheckpointIO, checkpoint_callback
from saopd.runs.folder import FiniteGuard, PreemptionCheckpoint
from saopd.runs.log import quiet_known_noise

__all__ = ["build_trainer", "data_parallel_size", "progress_callback", "strategy",
           "training_callbacks"]

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
    checkpoints written atomically, checksummed and finite (:mod:`saopd.runs.checkpoints`).
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
