"""Schema of how a run executes and is recorded: ``trainer``, ``logger``, ``paths``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from saopd.choices import LOGGERS
from saopd.validation import check_choice, check_int, check_positive

__all__ = ["LoggerConfig", "PathsConfig", "TrainerConfig"]


@dataclass
class TrainerConfig:
    """Lightning ``Trainer`` settings.

    Attributes:
        accelerator, devices, num_nodes, precision: as in Lightning
            (``precision``: ``32-true`` on CPU, ``bf16-mixed`` on GPU).
        strategy: ``auto`` (one process), ``ddp`` (data parallel, whole models on every rank)
            or ``fsdp`` (FSDP2 via Lightning's ``ModelParallelStrategy``: student, teacher and
            reference each sharded per decoder layer); any other Lightning strategy name is
            passed through. Multi-node: ``num_nodes`` with torchrun or SLURM (docs/scaling.md).
        process_group_backend: ``nccl`` / ``gloo`` (None = Lightning's choice: nccl on GPU,
            gloo on CPU).
        activation_checkpointing: recompute the student's decoder layers in backward.
        fsdp_mixed_precision: with ``strategy=fsdp``: ``bf16`` (compute in bfloat16, fp32 master
            weights and gradient reduction) or null; use it with ``precision: 32-true``.
        checkpoint_every_n_steps: save a checkpoint (and ``last.ckpt``) this often.
        keep_all_checkpoints: keep every periodic checkpoint (default: only the latest one and
            ``last.ckpt``; a student with AdamW state is ~3x its weights).
        view_every_n_steps: write the filtered-token HTML view this often (0 = never).
        progress_bar: show the run's progress (:class:`saopd.lightning.callbacks.ProgressLines`):
            a line with the step, loss, KL, FLMR, s/step and the time left, and one per
            evaluation with its scores and time; false: quiet (CI, sweeps whose jobs' output
            is noise).
        progress_bar_every_s: a progress line at least this often, in seconds of the run (and
            after the first and the last step; 0: after every step).
        threads: torch's intra-op CPU threads in each training process
            (``torch.set_num_threads``); null = torch's default (one per core). Tiny models run
            faster on one thread: with two, each small matrix product pays for the threads'
            synchronisation, and far more so when other work shares the cores.
    """

    accelerator: str = "cpu"
    devices: Any = 1
    num_nodes: int = 1
    strategy: str = "auto"
    precision: str = "32-true"
    process_group_backend: str | None = None
    activation_checkpointing: bool = False
    fsdp_mixed_precision: str | None = None
    checkpoint_every_n_steps: int = 10
    keep_all_checkpoints: bool = False
    view_every_n_steps: int = 10
    progress_bar: bool = True
    progress_bar_every_s: float = 10.0
    threads: int | None = None

    def __post_init__(self) -> None:
        check_int("threads", self.threads, owner="trainer", allow_none=True)
        check_int("checkpoint_every_n_steps", self.checkpoint_every_n_steps, owner="trainer")
        check_int("num_nodes", self.num_nodes, owner="trainer")
        check_positive("progress_bar_every_s", self.progress_bar_every_s, owner="trainer",
                       allow_zero=True)
        check_choice("process_group_backend", self.process_group_backend,
                     (None, "nccl", "gloo"), owner="trainer")
        check_choice("fsdp_mixed_precision", self.fsdp_mixed_precision, (None, "bf16"),
                     owner="trainer")
        if self.fsdp_mixed_precision is not None and self.strategy != "fsdp":
            raise ValueError("trainer.fsdp_mixed_precision applies to trainer.strategy=fsdp "
                             f"only (strategy is {self.strategy!r}); use trainer.precision")
        if not isinstance(self.view_every_n_steps, int) or self.view_every_n_steps < 0:
            raise ValueError(
                f"trainer.view_every_n_steps must be an int >= 0, got {self.view_every_n_steps!r}"
            )


@dataclass
class LoggerConfig:
    """Experiment tracking.

    Attributes:
        kind: ``mlflow`` or ``none``.
        tracking_uri: MLflow store; default ``sqlite:///<repo root>/mlflow.db``.
        experiment_name: MLflow experiment (default: the run's ``experiment_name``).
        run_name: MLflow run name (default: derived from experiment, filter and seed).
        tags: extra MLflow tags (sweep, study, ...).
    """

    kind: str = "mlflow"
    tracking_uri: str | None = None
    experiment_name: str | None = None
    run_name: str | None = None
    tags: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, LOGGERS, owner="logger")


@dataclass
class ResourcesConfig:
    """What one job asks a cluster launcher for (``conf/hydra/launcher/``: ``slurm``,
    ``slurm_local``, ``ray_cluster``); each experiment sets its own. Not read by training
    itself, and not a hyperparameter (a resumed run may change it).

    Attributes:
        nodes: nodes per job.
        tasks_per_node: processes per node (one per GPU under Lightning's DDP/FSDP on SLURM:
            match ``trainer.devices``).
        gpus_per_node: GPUs per node (0 on CPU).
        cpus_per_task: CPU cores per process.
        mem_gb: memory per node, in GB.
        timeout_min: the job's time limit in minutes; SLURM (through submitit) signals the job
            ``signal_delay_s`` before it, the job saves its step and is requeued.
    """

    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 2
    mem_gb: int = 8
    timeout_min: int = 60

    def __post_init__(self) -> None:
        for name in ("nodes", "tasks_per_node", "cpus_per_task"):
            check_int(name, getattr(self, name), owner="resources")
        check_int("gpus_per_node", self.gpus_per_node, owner="resources", minimum=0)
        check_int("mem_gb", self.mem_gb, owner="resources")
        check_int("timeout_min", self.timeout_min, owner="resources")


@dataclass
class PathsConfig:
    """Where things go. ``root``: the repository (data and the MLflow store); ``output_dir``:
    this run's folder (checkpoints, token views, the resolved config)."""

    root: str = MISSING
    output_dir: str = MISSING
