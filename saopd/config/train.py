"""Schema of ``saopd-train`` (``conf/train.yaml`` merges onto it) and its registration."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from saopd.choices import TEACHER_CONTEXTS
from saopd.config.data import DataConfig
from saopd.config.eval import EvalConfig, EvalDuringTrainingConfig
from saopd.config.model import ModelConfig
from saopd.config.rollout import RolloutConfig
from saopd.config.run import LoggerConfig, PathsConfig, ResourcesConfig, TrainerConfig
from saopd.config.step import OptimConfig, StepConfig
from saopd.config.teacher_scoring import TeacherScoringConfig
from saopd.validation import check_choice, check_int

__all__ = ["ROLLOUT_SCHEMAS", "TrainConfig", "register_schema", "rollout_schema_name",
           "to_train_config", "unknown_keys"]



def _rollout_schemas() -> dict[str, type[RolloutConfig]]:
    """Every subclass of :class:`RolloutConfig` in :mod:`saopd.config.rollout`, by the engine
    name its ``engine`` field defaults to (a new engine's dataclass is found without a list)."""
    return {cls.engine: cls for cls in RolloutConfig.__subclasses__()}


#: The schema of each rollout engine's YAML file (:func:`rollout_schema_name`), by engine name.
ROLLOUT_SCHEMAS: dict[str, type[RolloutConfig]] = _rollout_schemas()


def rollout_schema_name(engine: str) -> str:
    """The config-store name of ``engine``'s schema, ``rollout_<engine>_schema``: stored at the
    root, outside the ``rollout`` group, so ``--help`` lists only real engines there;
    ``conf/rollout/<engine>.yaml`` names it with an absolute path (``/rollout_<engine>_schema``)."""
    return f"rollout_{engine}_schema"


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
        resume: null (fresh run), ``auto`` (this job's own folder's ``last.ckpt``, else the
            latest of this experiment, if any; in a sweep job only its own), a run folder or a
            checkpoint path; resuming continues the same MLflow run (a copied folder, or another
            run's checkpoint, starts a new one: docs/runs.md). A resume whose training config
            differs from the checkpoint's is refused, naming the keys.
        resume_changes: keys a resume may change on purpose (``resume_changes=[optim.lr]``);
            each change is recorded in the run folder and on the MLflow run.
        student, teacher: the two models (``conf/model/*.yaml`` via ``model@student`` /
            ``model@teacher``; :class:`~saopd.config.model.ModelConfig`).
        filter, objective: a registered variant's ``name`` and its hyperparameters
            (``conf/filter``, ``conf/objective``), checked by the registries of
            :mod:`saopd.filters` / :mod:`saopd.objectives`, which know each variant's fields.
        rollout: the rollout engine's config, typed by the engine's own dataclass
            (:mod:`saopd.config.rollout`; the YAML's defaults list picks it).
        teacher_scoring: where the teacher's log-probs come from (``conf/teacher_scoring``:
            ``hf`` in the trainer, ``vllm`` / ``vllm_server`` on vLLM;
            :class:`~saopd.config.teacher_scoring.TeacherScoringConfig`).
        teacher_contexts: which contexts the teacher scores (:mod:`saopd.models.vocab`):
            ``auto`` (from the graded pair: the student's contexts for a ``same`` pair, the
            messages rendered in the teacher's own chat template for ``template_differs`` and
            ``specials_differ``), ``student`` (exactly the student's ids, as verl does; refused
            for ``specials_differ``, whose ids mean other tokens to the teacher) or ``own`` (the
            teacher's own template always; text pairs only). The graded kind and what the
            teacher scored are run params (``teacher_contexts.pair_kind``,
            ``teacher_contexts.scored``) and in ``summary.json``.
        data, trainer, logger, optim, step, eval, paths: see their dataclasses.
        resources: what one job asks a cluster launcher for (GPUs, CPUs, memory, time;
            :class:`~saopd.config.run.ResourcesConfig`).
    """

    student: ModelConfig = MISSING
    teacher: ModelConfig = MISSING
    filter: dict[str, Any] = MISSING
    objective: dict[str, Any] = MISSING
    rollout: Any = MISSING  # one of the RolloutConfig subclasses (conf/rollout/<engine>.yaml)
    teacher_scoring: TeacherScoringConfig = field(default_factory=TeacherScoringConfig)
    teacher_contexts: str = "auto"
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    step: StepConfig = field(default_factory=StepConfig)
    eval: EvalDuringTrainingConfig = field(default_factory=EvalDuringTrainingConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    experiment_name: str = "default"
    study: str | None = None
    method: str | None = None
    seed: int = 0
    steps: int = 10
    prompts_per_step: int = 4
    resume: str | None = None
    resume_changes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_int("steps", self.steps)
        check_int("prompts_per_step", self.prompts_per_step)
        check_choice("teacher_contexts", self.teacher_contexts, TEACHER_CONTEXTS)
        if not isinstance(self.rollout, RolloutConfig):
            raise ValueError("rollout must be one engine's config (conf/rollout/<engine>.yaml), "
                             f"got {type(self.rollout).__name__}")
        for group in ("filter", "objective"):
            value = getattr(self, group)
            if not isinstance(value, dict) or "name" not in value:
                raise ValueError(f"{group} must be a mapping with a 'name' key, got {value!r}")
        rollout = self.rollout
        if not rollout.greedy and (rollout.temperature != 1.0 or rollout.top_p < 1.0):
            raise ValueError(
                f"rollout.temperature={rollout.temperature}, rollout.top_p={rollout.top_p}: "
                "training scores every sampled token under the models' full distributions at "
                "temperature 1 (lpS, lpT, the filters' signals and the loss), the distribution "
                "on-policy distillation assumes the rollouts came from; a tempered or truncated "
                "sampler would make them off-policy with nothing correcting it. Train with "
                "rollout.temperature=1.0 and rollout.top_p=1.0 (rollout.greedy=true for "
                "debugging); evaluation samples apart from this (eval.temperature, eval.top_p)")


def register_schema() -> None:
    """Put every schema in Hydra's config store, where the YAML defaults lists name them:
    ``train_schema`` (``conf/train.yaml``), ``eval_schema`` (``conf/eval.yaml``) and
    :func:`rollout_schema_name` of each engine (``conf/rollout/<engine>.yaml``). All are stored
    at the root, in no group: Hydra's ``--help`` lists a group's every entry as a choice."""
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    store.store(name="eval_schema", node=EvalConfig)
    for name, node in ROLLOUT_SCHEMAS.items():
        store.store(name=rollout_schema_name(name), node=node)


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """Resolve interpolations and build (and so validate) the dataclasses.

    A key that is not in the schema is refused, naming it (and the nearest field), including one
    added with Hydra's ``+`` (``+rollout.temprature=0.01``), which OmegaConf would otherwise keep
    in the config and drop when building the dataclass."""
    unknown = unknown_keys(cfg, TrainConfig)
    if unknown:
        raise ValueError("unknown config key(s): " + "; ".join(unknown))
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, TrainConfig):
        raise ValueError(f"config does not follow the train schema (got {type(obj).__name__})")
    return obj


def unknown_keys(node: Any, schema: type, prefix: str = "") -> list[str]:
    """Keys of ``node`` (a ``DictConfig``) that ``schema`` (a dataclass) has no field for,
    recursively through the fields typed by dataclasses (the rollout node by its own engine's
    schema); free-form mappings (filter, objective, tags, template variables) are not checked.
    Each entry reads ``key (did you mean ...?)`` when a field name is close."""
    if not isinstance(node, DictConfig):
        return []
    own = OmegaConf.get_type(node)
    if isinstance(own, type) and dataclasses.is_dataclass(own) and issubclass(own, schema):
        schema = own  # e.g. VLLMRolloutConfig under the rollout field
    fields = {f.name: f for f in dataclasses.fields(schema)}
    out = []
    for name in node:
        key = str(name)
        if key == "hydra":
            continue
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            out.append(f"{prefix}{key}" + (f" (did you mean {prefix}{close[0]}?)" if close
                                           else f" ({prefix.rstrip('.') or 'the config'} has "
                                                f"no such field)"))
            continue
        sub = OmegaConf.get_type(node, key)
        if isinstance(sub, type) and dataclasses.is_dataclass(sub):
            out += unknown_keys(node[key], sub, f"{prefix}{key}.")
    return out
