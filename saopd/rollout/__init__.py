"""Rollout engines: sample responses from the current student.

``base`` is the engine contract (:class:`RolloutEngine`, :class:`SamplingParams`,
:class:`Rollout`, :class:`RolloutBatch`, and the stop-token policy every engine follows,
:func:`default_stop_token_ids`); ``registry`` holds :data:`ENGINES` and :func:`build_engine`.
Importing this package registers every engine: ``hf`` (:class:`HFGenerateEngine`, transformers
``generate`` on the live student; its sampler ``sampling``, its decode loop ``hf_decode``), and,
through the thin adapters of ``adapters``, ``vllm`` (:class:`~saopd.vllm.engine.VLLMEngine`) and
``vllm_server`` (:class:`~saopd.vllm.client.rollout.VLLMServerEngine`: ``saopd-serve`` servers
over HTTP), whose code is :mod:`saopd.vllm`, imported only when such an engine is built.
"""

from saopd.rollout import adapters, hf  # noqa: F401  (registration)
from saopd.rollout.base import (
    END_OF_TURN_TOKENS,
    Message,
    Rollout,
    RolloutBatch,
    RolloutEngine,
    SamplingParams,
    default_stop_token_ids,
)
from saopd.rollout.hf import HFGenerateEngine
from saopd.rollout.registry import ENGINES, EngineSetup, build_engine, holds_weights

__all__ = [
    "END_OF_TURN_TOKENS",
    "ENGINES",
    "EngineSetup",
    "HFGenerateEngine",
    "Message",
    "Rollout",
    "RolloutBatch",
    "RolloutEngine",
    "SamplingParams",
    "build_engine",
    "default_stop_token_ids",
    "holds_weights",
]
