"""Per-token signals: chunked log-probs/entropies/KL and the :class:`TokenSignals` container."""

from saopd.signals.token_signals import LOGPROB_FLOOR, TokenSignals

__all__ = ["LOGPROB_FLOOR", "TokenSignals"]
