"""Data adapters: full and residual contexts for SA-OPD scoring."""

from saopd.data.contexts import (
    DEFAULT_NEUTRAL_PROMPT,
    RESIDUAL_MODES,
    TRUNCATION_MODES,
    ContextBatch,
    Contexts,
    PairedContextBatch,
    build_contexts,
    collate_contexts,
    gather_response_logprobs,
    pad_contexts,
    render_prompt_ids,
    residual_messages,
    residual_start_token_id,
    response_positions,
)

__all__ = [
    "DEFAULT_NEUTRAL_PROMPT",
    "RESIDUAL_MODES",
    "TRUNCATION_MODES",
    "ContextBatch",
    "Contexts",
    "PairedContextBatch",
    "build_contexts",
    "collate_contexts",
    "gather_response_logprobs",
    "pad_contexts",
    "render_prompt_ids",
    "residual_messages",
    "residual_start_token_id",
    "response_positions",
]
