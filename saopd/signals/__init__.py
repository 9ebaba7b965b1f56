"""Per-token signals: chunked log-probs/entropy/KL and the :class:`TokenSignals` container."""

from saopd.signals.logprobs import TokenScores, default_chunk_size, score_tokens
from saopd.signals.sources import LMHead, Logits, LogitSource
from saopd.signals.token_signals import LOGPROB_FLOOR, TokenSignals

__all__ = [
    "LOGPROB_FLOOR",
    "LMHead",
    "LogitSource",
    "Logits",
    "TokenScores",
    "TokenSignals",
    "default_chunk_size",
    "score_tokens",
]
