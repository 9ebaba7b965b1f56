"""The typed, torch-free schema of every config group, in one package.

OmegaConf checks types and refuses unknown keys when the YAML files (``conf/``) and
command-line overrides are merged onto these dataclasses; :func:`to_train_config` instantiates
them, and each ``__post_init__`` checks value ranges (the error names the key and the allowed
range). The YAML files hold only what differs from the defaults written here. Filters and
objectives are free-form mappings (``name`` + hyperparameters) checked by their registries.

Nothing here imports torch, Lightning or transformers (the import contract in
``pyproject.toml`` enforces it), so configs can be composed and checked anywhere.
"""

from saopd.config.data import DataConfig
from saopd.config.eval import EvalConfig, EvalDuringTrainingConfig
from saopd.config.model import ModelConfig, PlantedConfig
from saopd.config.rollout import HFRolloutConfig, RolloutConfig, VLLMRolloutConfig
from saopd.config.run import LoggerConfig, PathsConfig, ResourcesConfig, TrainerConfig
from saopd.config.step import OptimConfig, StepConfig
from saopd.config.teacher_scoring import TeacherScoringConfig
from saopd.config.train import (
    ROLLOUT_SCHEMAS,
    TrainConfig,
    register_schema,
    rollout_schema_name,
    to_train_config,
)

__all__ = [
    "ROLLOUT_SCHEMAS",
    "DataConfig",
    "EvalConfig",
    "EvalDuringTrainingConfig",
    "HFRolloutConfig",
    "LoggerConfig",
    "ModelConfig",
    "OptimConfig",
    "PathsConfig",
    "PlantedConfig",
    "ResourcesConfig",
    "RolloutConfig",
    "StepConfig",
    "TeacherScoringConfig",
    "TrainConfig",
    "TrainerConfig",
    "VLLMRolloutConfig",
    "register_schema",
    "rollout_schema_name",
    "to_train_config",
]
