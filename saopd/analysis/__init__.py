"""Analysis helpers: looking at which tokens a filter removed, and why (paper, Appendix E)."""

from saopd.analysis.token_view import (
    TokenRow,
    render_token_view,
    rows_stats,
    token_rows_from_batch,
    token_rows_from_signals,
)

__all__ = [
    "TokenRow",
    "render_token_view",
    "rows_stats",
    "token_rows_from_batch",
    "token_rows_from_signals",
]
