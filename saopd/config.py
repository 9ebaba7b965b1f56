"""Typed schema of ``saopd-train``'s Hydra config (``conf/train.yaml`` merges onto it).

Every group is a dataclass: OmegaConf checks types and refuses unknown keys when the YAML files
and command-line overrides are merged, and :func:`to_train_config` instantiates the dataclasses,
whose ``__post_init__`` checks value ranges (the error names the key and the allowed range).
Filters and objectives are free-form dicts (``name`` + hyperparameters) validated by their
registries, which know each variant's fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from saopd._checks import check_choice, check_fraction, check_positive
from saopd.data.prompts import GSM8K_INSTRUCTION
from saopd.lightning.module import OptimConfig, StepConfig
from saopd.models.factory import ModelConfig

LONG_PROMPT_MODES = ("skip", "error", "truncate")
DATA_SOURCES = ("gsm8k", "prepared", "vision")
VISION_RESIDUAL_MODES = ("all", "image", "text")  # saopd.data.vision (kept torch-free here)
ENGINES = ("hf", "vllm")
VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")
SYNC_TRANSPORTS = ("auto", "iterator", "files")  # saopd.rollout.vllm (kept vllm-free here)
LOGGERS = ("mlflow", "none")


def _positive_int(owner: str, name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        what = "null or an int >= 1" if allow_none else "an int >= 1"
        key = f"{owner}.{name}" if owner else name
        raise ValueError(f"{key} must be {what}, got {value!r}")


@dataclass
class RolloutConfig:
    """Sampling of the student's responses (one call per step).

    Attributes:
        engine: ``hf`` (transformers ``generate`` on the live student, CPU/GPU) or ``vllm``
            (:class:`saopd.rollout.vllm.VLLMEngine`: a vLLM copy of the student, synced after
            every step; needs the ``vllm`` package, see the README).
        n: responses per prompt.
        temperature, top_p: sampling (the paper: 1.0, 1.0 in training).
        max_new_tokens: response length limit.
        batch_size: ``hf`` only: prompts per ``generate`` call (None = all of the step's
            prompts; vLLM schedules its own batches).
        greedy: argmax decoding instead of sampling (debugging, evaluation).
        importance_ratio_cap: the default of the sampled objectives' ``importance_ratio_cap``
            (``conf/objective/{sampled,exopd}.yaml`` read it): the truncated importance ratio
            corrects the sampler/trainer mismatch; null with ``hf`` (sampler == trainer), 5.0
            with ``vllm``.

    vLLM only (ignored by ``hf``):
        dtype: ``auto`` (the student's) | ``float32`` | ``bfloat16`` | ``float16``.
        max_model_len: prompt + response limit (null = the model's).
        gpu_memory_utilization: memory fraction for weights + KV cache, in (0, 1] (on the CPU
            backend: of the machine's RAM).
        kv_cache_gb: KV-cache size in GiB instead of the fraction (null = use the fraction).
        enforce_eager: no CUDA graphs / compilation (faster start-up, slower decoding).
        tensor_parallel_size: GPUs the engine shards the model over.
        enable_sleep_mode, sleep_level: sleep between rollouts to free GPU memory for the step
            (level 1 offloads weights to CPU; level 2 drops them: reported to return stale
            weights after wake-up, keep ``verify_sync`` on). GPU only.
        weight_bucket_mb: size of the buckets a weight sync gathers (FSDP) and ships in, MiB.
        sync_transport: ``auto`` | ``iterator`` (tensors through ``collective_rpc``, in-process
            only) | ``files`` (safetensors shards in ``/dev/shm``).
        in_process: engine core in the training process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
        verify_sync: check that every sync landed (cheap sums of embeddings and norms).
        model_dir: where the initial student is saved for vLLM (null = a temporary folder in
            ``/dev/shm``, removed at exit).
        max_images_per_prompt: vLLM's image limit per prompt for vision-language students
            (``limit_mm_per_prompt``; vLLM reserves memory for this many); a prompt with more
            images is refused, naming it. Ignored by ``hf`` and for text models.
    """

    engine: str = "hf"
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    batch_size: int | None = None
    greedy: bool = False
    importance_ratio_cap: float | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_gb: float | None = None
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    enable_sleep_mode: bool = False
    sleep_level: int = 1
    weight_bucket_mb: int = 512
    sync_transport: str = "auto"
    in_process: bool = True
    verify_sync: bool = True
    model_dir: str | None = None
    max_images_per_prompt: int = 4

    def __post_init__(self) -> None:
        check_choice("engine", self.engine, ENGINES, owner="rollout")
        _positive_int("rollout", "n", self.n)
        _positive_int("rollout", "max_new_tokens", self.max_new_tokens)
        _positive_int("rollout", "batch_size", self.batch_size, allow_none=True)
        _positive_int("rollout", "max_images_per_prompt", self.max_images_per_prompt)
        check_positive("temperature", self.temperature, owner="rollout")
        check_fraction("top_p", self.top_p, owner="rollout")
        if self.importance_ratio_cap is not None:
            check_positive("importance_ratio_cap", self.importance_ratio_cap, owner="rollout")
        check_choice("dtype", self.dtype, VLLM_DTYPES, owner="rollout")
        _positive_int("rollout", "max_model_len", self.max_model_len, allow_none=True)
        check_fraction("gpu_memory_utilization", self.gpu_memory_utilization, owner="rollout")
        if self.gpu_memory_utilization == 0:
            raise ValueError("rollout.gpu_memory_utilization must be in (0, 1], got 0")
        if self.kv_cache_gb is not None:
            check_positive("kv_cache_gb", self.kv_cache_gb, owner="rollout")
        _positive_int("rollout", "tensor_parallel_size", self.tensor_parallel_size)
        if self.sleep_level not in (1, 2):
            raise ValueError(f"rollout.sleep_level must be 1 or 2, got {self.sleep_level!r}")
        _positive_int("rollout", "weight_bucket_mb", self.weight_bucket_mb)
        check_choice("sync_transport", self.sync_transport, SYNC_TRANSPORTS, owner="rollout")


@dataclass
class DataConfig:
    """Training prompts.

    Attributes:
        source: ``gsm8k`` (JSONL rows with ``question``/``answer``), ``prepared`` (the DVC
            pipeline's schema: ``id``, ``messages``, ``answer``; ``system_prompt`` and
            ``instruction`` do not apply, the prepared messages are used as they are) or
            ``vision`` (the same schema with image parts in the user turn, image paths relative
            to the JSONL: ``dvc repro prepare_vlm``; needs a vision-language student/teacher).
        path: the JSONL file.
        limit: use only the first ``limit`` rows.
        system_prompt: optional system turn before each question.
        instruction: text appended to each question (null = the bare question).
        skip_bad: skip malformed rows (counted) instead of stopping at the first one.
        max_prompt_length: prompts whose rendered chat template is longer are ``skip``-ped
            (counted), raise (``error``), or are left-truncated when contexts are built
            (``truncate``).
        shuffle: shuffle the prompt order (seeded per epoch).
        residual_remove: ``source: vision`` only: what the residual context removes from the
            prompt: ``all`` (images and question, the default), ``image`` (images only) or
            ``text`` (question only, images kept).
        chat_template_kwargs: extra chat-template variables for every prompt source, in the
            prompt-length filter, rollouts and contexts alike (``{enable_thinking: false}``:
            Qwen3/Qwen3.5's non-thinking mode).
    """

    source: str = "gsm8k"
    path: str = MISSING
    limit: int | None = None
    system_prompt: str | None = None
    instruction: str | None = GSM8K_INSTRUCTION
    skip_bad: bool = False
    max_prompt_length: int | None = None
    long_prompts: str = "skip"
    shuffle: bool = True
    residual_remove: str = "all"
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_choice("source", self.source, DATA_SOURCES, owner="data")
        check_choice("residual_remove", self.residual_remove, VISION_RESIDUAL_MODES, owner="data")
        check_choice("long_prompts", self.long_prompts, LONG_PROMPT_MODES, owner="data")
        _positive_int("data", "limit", self.limit, allow_none=True)
        _positive_int("data", "max_prompt_length", self.max_prompt_length, allow_none=True)


@dataclass
class TrainerConfig:
    """Lightning ``Trainer`` settings.

    Attributes:
        accelerator, devices, num_nodes, precision: as in Lightning
            (``precision``: ``32-true`` on CPU, ``bf16-mixed`` on GPU).
        strategy: ``auto`` (one process), ``ddp`` (data parallel, whole models on every rank)
            or ``fsdp`` (FSDP2 via Lightning's ``ModelParallelStrategy``: student, teacher and
            reference each sharded per decoder layer); any other Lightning strategy name is
            passed through. Multi-node: ``num_nodes`` with torchrun or SLURM (README).
        process_group_backend: ``nccl`` / ``gloo`` (None = Lightning's choice: nccl on GPU,
            gloo on CPU).
        activation_checkpointing: recompute the student's decoder layers in backward.
        fsdp_mixed_precision: with ``strategy=fsdp``: ``bf16`` (compute in bfloat16, fp32 master
            weights and gradient reduction) or null; use it with ``precision: 32-true``.
        checkpoint_every_n_steps: save a checkpoint (and ``last.ckpt``) this often.
        keep_all_checkpoints: keep every periodic checkpoint (default: only the latest one and
            ``last.ckpt``; a student with AdamW state is ~3x its weights).
        view_every_n_steps: write the filtered-token HTML view this often (0 = never).
        progress_bar: show Lightning's progress bar.
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

    def __post_init__(self) -> None:
        _positive_int("trainer", "checkpoint_every_n_steps", self.checkpoint_every_n_steps)
        _positive_int("trainer", "num_nodes", self.num_nodes)
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
class EvalDuringTrainingConfig:
    """Evaluation of the live student every N steps (same code as ``saopd-eval``).

    Attributes:
        every_n_steps: 0 = never.
        benchmarks: gsm8k (vendored test split) and/or prepared benchmarks in ``data_dir``.
        limit: problems per benchmark (a fixed subset: the first ``limit``).
        k, temperature, top_p, max_new_tokens: sampling per problem (Avg@k).
        data_dir: where ``dvc repro prepare_eval`` writes the prepared benchmarks.
    """

    every_n_steps: int = 0
    benchmarks: list[str] = field(default_factory=lambda: ["gsm8k"])
    limit: int | None = 32
    k: int = 1
    temperature: float = 1.0
    top_p: float = 0.95
    max_new_tokens: int = 256
    data_dir: str = MISSING

    def __post_init__(self) -> None:
        if not isinstance(self.every_n_steps, int) or self.every_n_steps < 0:
            raise ValueError(f"eval.every_n_steps must be an int >= 0, got {self.every_n_steps!r}")
        _positive_int("eval", "k", self.k)
        _positive_int("eval", "limit", self.limit, allow_none=True)
        _positive_int("eval", "max_new_tokens", self.max_new_tokens)


@dataclass
class PathsConfig:
    """Where things go. ``root``: the repository (data and the MLflow store); ``output_dir``:
    this run's folder (checkpoints, token views, the resolved config)."""

    root: str = MISSING
    output_dir: str = MISSING


@dataclass
class TrainConfig:
    """Everything ``saopd-train`` needs; see ``conf/train.yaml`` and ``conf/experiment/``.

    Attributes:
        experiment_name: names the MLflow experiment and the output folder.
        study: the study (``experiments/<study>``) this run belongs to; tagged on its MLflow
            run, with the sweep it ran in, so ``saopd-report --tag study=<name>`` finds it.
        method: the method's table label (``conf/method/*.yaml``: OPD, ExOPD, TIP, FiRe-OPD,
            SA-OPD), tagged ``method`` on the MLflow run; null = derived from filter/objective.
        seed: seeds model init, prompt order, sampling and the random filter.
        steps: optimizer steps (one rollout batch each).
        prompts_per_step: prompts per step (x ``rollout.n`` responses).
        resume: null (fresh run), ``auto`` (the latest ``last.ckpt`` of this experiment, if
            any) or a checkpoint path; resuming continues the same MLflow run.
        reference_from_student: build ExOPD's frozen reference as a copy of the initial student
            (only when the objective needs it).
    """

    student: ModelConfig = MISSING
    teacher: ModelConfig = MISSING
    filter: dict[str, Any] = MISSING
    objective: dict[str, Any] = MISSING
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    step: StepConfig = field(default_factory=StepConfig)
    eval: EvalDuringTrainingConfig = field(default_factory=EvalDuringTrainingConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    experiment_name: str = "default"
    study: str | None = None
    method: str | None = None
    seed: int = 0
    steps: int = 10
    prompts_per_step: int = 4
    resume: str | None = None

    def __post_init__(self) -> None:
        _positive_int("", "steps", self.steps)
        _positive_int("", "prompts_per_step", self.prompts_per_step)
        for group in ("filter", "objective"):
            value = getattr(self, group)
            if not isinstance(value, dict) or "name" not in value:
                raise ValueError(f"{group} must be a mapping with a 'name' key, got {value!r}")


def register_schema() -> None:
    """Make ``train_schema`` available to ``conf/train.yaml``'s defaults list."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """Resolve interpolations and build (and so validate) the dataclasses."""
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, TrainConfig):
        raise ValueError(f"config does not follow the train schema (got {type(obj).__name__})")
    return obj
