"""The registry of rollout engines, and how the configured one is built.

Each engine class registers itself under the name its config carries (``rollout.engine``,
set by ``conf/rollout/<engine>.yaml``) and provides ``from_config(conf, student, tokenizer,
setup)``, where ``conf`` is its own dataclass of :mod:`saopd.config.rollout` and ``setup`` an
:class:`EngineSetup` (what the run adds: prompt limit, seed, template variables, processor,
training processes). ``saopd-train``, ``saopd-eval`` and evaluation during training all build
their engine through :func:`build_engine`.

Adding an engine: a module in :mod:`saopd.rollout` with a class decorated
``@ENGINES.register("<name>")`` (or, for an engine whose code lives above this package, as
:mod:`saopd.vllm`'s does, a thin adapter in :mod:`saopd.rollout.adapters`), a config dataclass
in :mod:`saopd.config.rollout` (registered in :data:`saopd.config.train.ROLLOUT_SCHEMAS`),
``conf/rollout/<name>.yaml`` and a test.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from saopd.choices import LONG_PROMPT_MODES
from saopd.data_parallel import num_training_processes
from saopd.registry import Registry
from saopd.rollout.base import RolloutEngine
from saopd.validation import check_choice, check_int

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from saopd.config.rollout import RolloutConfig
    from saopd.config.train import TrainConfig
    from saopd.models.factory import ModelPair

__all__ = ["ENGINES", "EngineSetup", "build_engine", "build_run_engine", "holds_weights"]

#: Rollout engine classes by config name (``hf``, ``vllm``, ``vllm_server``).
ENGINES: Registry[Any] = Registry("rollout engine")


@dataclass(frozen=True)
class EngineSetup:
    """What a run gives every engine besides the engine's own config.

    Attributes:
        max_prompt_length: limit on rendered prompt tokens (None = no limit).
        prompt_truncation: what happens to a longer prompt (one of
            :data:`saopd.choices.LONG_PROMPT_MODES`).
        seed: the engine's own seed (requests carry their own seeds when sampling is seeded).
        chat_template_kwargs: extra chat-template variables (``enable_thinking: false``).
        processor: the student's processor for a vision-language student, else None.
        devices, num_nodes: the trainer's (how many training processes will sample).
    """

    max_prompt_length: int | None = None
    prompt_truncation: str = "truncate"
    seed: int = 0
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    processor: Any | None = None
    devices: Any = 1
    num_nodes: int = 1

    def __post_init__(self) -> None:
        check_int("max_prompt_length", self.max_prompt_length, owner="engine",
                  allow_none=True)
        check_choice("prompt_truncation", self.prompt_truncation, LONG_PROMPT_MODES,
                     owner="engine")
        check_int("seed", self.seed, owner="engine", minimum=0)

    @property
    def training_processes(self) -> int:
        """How many training processes this run starts (:func:`num_training_processes`)."""
        return num_training_processes(self.devices, self.num_nodes)


def holds_weights(engine: RolloutEngine) -> bool:
    """True for engines with their own copy of the weights (vLLM): they need ``load_weights``
    after every optimizer step (and once at the start, after a checkpoint is restored)."""
    return bool(getattr(engine, "holds_weights", False))


def build_engine(conf: RolloutConfig, student: PreTrainedModel,
                 tokenizer: PreTrainedTokenizerBase, **setup: Any) -> RolloutEngine:
    """The rollout engine ``conf.engine`` names (:data:`ENGINES`), sampling from ``student``.

    ``conf`` is the engine's config dataclass; ``setup`` the fields of :class:`EngineSetup`.
    Raises ``ValueError`` for an unknown engine (listing the registered ones) or options the
    engine refuses, ``ImportError`` when the engine's package is missing (saying how to install
    it).
    """
    return ENGINES.get(conf.engine).from_config(conf, student, tokenizer, EngineSetup(**setup))


def build_run_engine(conf: TrainConfig, pair: ModelPair) -> RolloutEngine:
    """The rollout engine of a training run: ``conf.rollout`` sampling from the pair's student,
    with the run's prompt limit (``data.max_prompt_length``, ``data.long_prompts``), seed,
    chat-template variables and training processes (:class:`EngineSetup`)."""
    return build_engine(
        conf.rollout, pair.student, pair.tokenizer,
        max_prompt_length=conf.data.max_prompt_length,
        prompt_truncation="truncate" if conf.data.long_prompts == "truncate" else "error",
        seed=conf.seed, devices=conf.trainer.devices, num_nodes=conf.trainer.num_nodes,
        chat_template_kwargs=conf.data.chat_template_kwargs, processor=pair.processor)
