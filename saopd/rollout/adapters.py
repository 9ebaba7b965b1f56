"""The vLLM rollout engines as the registry knows them: thin adapters, registered under their
config names, that import their engine from :mod:`saopd.vllm` only when one is built.

- ``rollout=vllm``: :class:`VLLMAdapter` -> :class:`saopd.vllm.engine.VLLMEngine` (a colocated
  ``vllm.LLM`` holding a copy of the student);
- ``rollout=vllm_server``: :class:`VLLMServerAdapter` ->
  :class:`saopd.vllm.client.rollout.VLLMServerEngine` (``saopd-serve`` servers over HTTP).

Importing :mod:`saopd.rollout` registers both without importing :mod:`saopd.vllm` (nor, so, the
``vllm`` package). :mod:`saopd.vllm` implements this package's engine contract and sits above it
in the layer contract; the two imports here are the only ones from :mod:`saopd.rollout` into it
(``ignore_imports`` of the layers contract in pyproject.toml).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from saopd.rollout.registry import ENGINES, EngineSetup

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from saopd.rollout.base import RolloutEngine

__all__ = ["LazyEngine", "VLLMAdapter", "VLLMServerAdapter"]


class LazyEngine:
    """A registered engine whose class lives outside :mod:`saopd.rollout`: ``from_config`` imports
    it (:meth:`engine_class`) and builds it with that class's own ``from_config``."""

    holds_weights = True  # both vLLM engines need load_weights after every optimizer step

    @classmethod
    def engine_class(cls) -> Any:
        """The engine class (imported here, on first use)."""
        raise NotImplementedError

    @classmethod
    def from_config(cls, conf: Any, student: PreTrainedModel,
                    tokenizer: PreTrainedTokenizerBase, setup: EngineSetup) -> RolloutEngine:
        """The engine :meth:`engine_class` builds from ``conf`` (its config dataclass)."""
        engine: RolloutEngine = cls.engine_class().from_config(conf, student, tokenizer, setup)
        return engine


@ENGINES.register("vllm")
class VLLMAdapter(LazyEngine):
    """``rollout=vllm``: :class:`saopd.vllm.engine.VLLMEngine`."""

    @classmethod
    def engine_class(cls) -> Any:
        from saopd.vllm.engine import VLLMEngine

        return VLLMEngine


@ENGINES.register("vllm_server")
class VLLMServerAdapter(LazyEngine):
    """``rollout=vllm_server``: :class:`saopd.vllm.client.rollout.VLLMServerEngine`."""

    @classmethod
    def engine_class(cls) -> Any:
        from saopd.vllm.client.rollout import VLLMServerEngine

        return VLLMServerEngine
