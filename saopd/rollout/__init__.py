"""Rollout engines: sample responses from the current student.

``base`` defines the protocol (:class:`RolloutEngine`, :class:`SamplingParams`, :class:`Rollout`,
:class:`RolloutBatch`); :class:`HFGenerateEngine` samples from the live student with HF
``generate`` (transformers is imported on first use).
"""

from saopd.rollout.base import Message, Rollout, RolloutBatch, RolloutEngine, SamplingParams
from saopd.rollout.hf import (
    END_OF_TURN_TOKENS,
    PROMPT_TRUNCATION_MODES,
    HFGenerateEngine,
    default_stop_token_ids,
)

__all__ = [
    "END_OF_TURN_TOKENS",
    "PROMPT_TRUNCATION_MODES",
    "HFGenerateEngine",
    "Message",
    "Rollout",
    "RolloutBatch",
    "RolloutEngine",
    "SamplingParams",
    "default_stop_token_ids",
]
