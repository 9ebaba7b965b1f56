"""Rollout engines: sample responses from the current student.

``base`` defines the protocol (:class:`RolloutEngine`, :class:`SamplingParams`, :class:`Rollout`,
:class:`RolloutBatch`); ``registry`` holds :data:`ENGINES` and :func:`build_engine`. Importing
this package registers every engine: ``hf`` (:class:`HFGenerateEngine`, transformers
``generate`` on the live student), ``vllm`` (:class:`~saopd.rollout.vllm.VLLMEngine`; the
``vllm`` package itself is imported only when such an engine starts) and ``vllm_server``
(:class:`~saopd.rollout.vllm_server.VLLMServerEngine`: ``saopd-serve`` servers over HTTP).
"""

from saopd.rollout import hf, vllm, vllm_server  # noqa: F401  (registration)
from saopd.rollout.base import Message, Rollout, RolloutBatch, RolloutEngine, SamplingParams
from saopd.rollout.hf import END_OF_TURN_TOKENS, HFGenerateEngine, default_stop_token_ids
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
