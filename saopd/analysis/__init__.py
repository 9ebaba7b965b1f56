"""Analysis: which tokens a filter removed and why, and the paper's tables and figures.

Modules (import them directly; only the torch-free token view is re-exported here, so importing
this package stays light):

- :mod:`~saopd.analysis.token_view`: the filtered-token HTML view (Appendix E).
- :mod:`~saopd.analysis.token_records`: per-step token records on disk (what training saves).
- :mod:`~saopd.analysis.token_stats`: Table 4 token statistics, filtered vs kept.
- :mod:`~saopd.analysis.collect`: MLflow runs and metric histories as pandas frames.
- :mod:`~saopd.analysis.tables`: seed-aggregated results tables (Markdown, LaTeX, HTML).
- :mod:`~saopd.analysis.plots`: training dynamics (Figure 4) and entropy (Figure 3b) figures.
- :mod:`~saopd.analysis.reporting`: output files and the MLflow report run (``saopd-report``).
"""

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
