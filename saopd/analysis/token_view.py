"""Filtered-token view: sampled responses as a self-contained HTML page (paper, Appendix E).

Each response is shown token by token, as in the paper's filtered-token figures: the background
colour of a token encodes its teacher-student divergence A_full = lpS - lpT (Eq. 12) on a diverging
scale, tokens a filter removed from the loss (the set F of Eq. 16) are outlined, and hovering a
token shows ``token | A_full | A_res | gap | filtered`` with the input-grounding gap
|A_full - A_res| (Eq. 14). A header gives the step, the filter and batch statistics (FLMR of
Eq. 17, filtered ratio, mean gap over filtered vs kept tokens).

With ``annotate=True`` the two values are also printed under every token, as in the paper's
Appendix E figures: ``F`` = A_full and ``Δ`` = the grounding gap.

Colours: red = A_full > 0 (the student gives the sampled token more probability than the teacher:
the teacher prefers it less, the student is over-confident), blue = A_full < 0 (the teacher
prefers it more). Saturation grows with |A_full| up to ``vmax``.

The page uses inline CSS only (no scripts, no external assets) so it can be written to disk,
logged as an MLflow artifact and opened anywhere. Everything taken from the data (tokens, prompts,
titles, stat keys) is HTML-escaped. Newlines inside tokens render as a visible ``↵`` followed by a
line break; other whitespace is kept as is (``white-space: pre-wrap``).

Pure Python: tensors are accepted (anything with ``.tolist()``) but torch is never imported.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from saopd.filters.base import FilterResult
    from saopd.signals.token_signals import TokenSignals

__all__ = [
    "TokenRow",
    "render_token_view",
    "rows_stats",
    "token_rows_from_batch",
    "token_rows_from_signals",
]

NEWLINE_MARK = "\u21b5"  # ↵, shown in place of "\n" (followed by a real line break)
CARRIAGE_RETURN_MARK = "\u240d"  # ␍
EMPTY_TOKEN_MARK = "\u2205"  # ∅, for a token that decodes to the empty string

# RdBu end points (ColorBrewer) and the neutral middle.
_NEG_RGB = (33, 102, 172)  # blue: A_full < 0
_MID_RGB = (247, 247, 247)
_POS_RGB = (178, 24, 43)  # red: A_full > 0
_LIGHT_TEXT_ABOVE = 0.6  # switch to white text beyond this share of vmax

# Stats shown first and how they are labelled (keys of saopd.filters.base.filter_stats).
_STAT_LABELS: dict[str, str] = {
    "flmr": "FLMR",
    "filtered_ratio": "filtered ratio",
    "grounding_gap_filtered": "mean gap (filtered)",
    "grounding_gap_kept": "mean gap (kept)",
    "abs_a_filtered": "mean |A_full| (filtered)",
    "abs_a_kept": "mean |A_full| (kept)",
    "n_valid": "valid tokens",
    "n_filtered": "filtered tokens",
    "alpha": "alpha",
    "p1": "p1",
    "p2": "p2",
}


@dataclass
class TokenRow:
    """One response, token by token, with its signals; all lists have one entry per token.

    Attributes:
        prompt: the prompt text shown above the response (truncated when rendered).
        tokens: decoded text of each valid response token, in order.
        a_full: A_full = lpS - lpT per token (Eq. 12).
        a_res: A_res = lpS_res - lpT_res per token (Eq. 13), ``None`` without a residual pass.
        filtered: True = the token is in F (removed from the loss), False = kept.
        entropy_student: full-vocabulary student entropy H_S per token (nats), ``None`` when the
            step did not compute it (only filters/objectives that need it do).
    """

    prompt: str
    tokens: list[str]
    a_full: list[float]
    a_res: list[float] | None
    filtered: list[bool]
    entropy_student: list[float] | None = None

    def __post_init__(self) -> None:
        n = len(self.tokens)
        lengths = {"a_full": len(self.a_full), "filtered": len(self.filtered)}
        if self.a_res is not None:
            lengths["a_res"] = len(self.a_res)
        if self.entropy_student is not None:
            lengths["entropy_student"] = len(self.entropy_student)
        bad = {k: v for k, v in lengths.items() if v != n}
        if bad:
            raise ValueError(f"TokenRow has {n} tokens but field lengths {bad}")

    @property
    def gap(self) -> list[float] | None:
        """Input-grounding gap |A_full - A_res| per token (Eq. 14), ``None`` without A_res."""
        if self.a_res is None:
            return None
        return [abs(f - r) for f, r in zip(self.a_full, self.a_res, strict=True)]


# ---- building rows from a batch -------------------------------------------------------------

def _as_rows(name: str, x: Any) -> list[list[Any]]:
    """A [B, R] tensor / array / nested list as a list of python lists."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
    if hasattr(x, "tolist"):
        x = x.tolist()
    if not isinstance(x, Sequence) or not all(isinstance(r, Sequence) for r in x):
        raise ValueError(f"{name} must be 2-D [B, R], got {type(x).__name__}")
    return [list(r) for r in x]


def decode_tokens(tokenizer: Any, ids: list[int]) -> list[str]:
    """Text of each id on its own, so byte-level BPE markers (Ġ, Ċ) become spaces/newlines."""
    pieces = tokenizer.convert_ids_to_tokens(ids)
    out = []
    for i, piece in zip(ids, pieces, strict=True):
        if piece is None:  # id outside the vocabulary
            out.append(f"<id {i}>")
        else:
            out.append(tokenizer.convert_tokens_to_string([piece]))
    return out


def token_rows_from_batch(tokenizer: Any, prompts: list[str], response_ids: Any, valid: Any,
                          a_full: Any, a_res: Any | None, filtered: Any,
                          max_rows: int | None = 8,
                          entropy_student: Any | None = None) -> list[TokenRow]:
    """The first ``max_rows`` responses of a batch as :class:`TokenRow` s.

    Args:
        tokenizer: a Hugging Face tokenizer (``convert_ids_to_tokens``,
            ``convert_tokens_to_string``).
        prompts: B prompt texts.
        response_ids: int [B, R] response token ids.
        valid: bool [B, R], True = a real response token (only these become tokens of a row).
        a_full: float [B, R], A_full (Eq. 12), e.g. ``TokenSignals.a_full``.
        a_res: float [B, R], A_res (Eq. 13), or ``None``.
        filtered: bool [B, R], True = in F (``FilterResult.filtered``); read only where valid.
        max_rows: how many responses to keep (from the start of the batch); ``None``: all.
        entropy_student: float [B, R], student entropy H_S (``TokenSignals.entropy_student``),
            or ``None``.
    """
    ids_rows = _as_rows("response_ids", response_ids)
    tables = {"valid": _as_rows("valid", valid), "a_full": _as_rows("a_full", a_full),
              "filtered": _as_rows("filtered", filtered)}
    if a_res is not None:
        tables["a_res"] = _as_rows("a_res", a_res)
    if entropy_student is not None:
        tables["entropy_student"] = _as_rows("entropy_student", entropy_student)
    shape = (len(ids_rows), len(ids_rows[0]) if ids_rows else 0)
    for name, table in tables.items():
        got = (len(table), len(table[0]) if table else 0)
        if got != shape or any(len(r) != shape[1] for r in table):
            raise ValueError(f"{name} has shape {got}, response_ids has {shape}")
    if len(prompts) != shape[0]:
        raise ValueError(f"got {len(prompts)} prompts for a batch of {shape[0]} responses")

    rows = []
    n_rows = shape[0] if max_rows is None else min(shape[0], max(max_rows, 0))
    for b in range(n_rows):
        cols = [t for t in range(shape[1]) if tables["valid"][b][t]]

        def floats(name: str, b: int = b, cols: list[int] = cols) -> list[float] | None:
            table = tables.get(name)
            return None if table is None else [float(table[b][t]) for t in cols]

        rows.append(TokenRow(
            prompt=prompts[b],
            tokens=decode_tokens(tokenizer, [int(ids_rows[b][t]) for t in cols]),
            a_full=floats("a_full") or [],
            a_res=floats("a_res"),
            filtered=[bool(tables["filtered"][b][t]) for t in cols],
            entropy_student=floats("entropy_student"),
        ))
    return rows


def token_rows_from_signals(tokenizer: Any, prompts: list[str], response_ids: Any,
                            signals: TokenSignals, result: FilterResult,
                            max_rows: int = 8) -> list[TokenRow]:
    """:func:`token_rows_from_batch` fed from a step's ``TokenSignals`` and ``FilterResult``.

    ``response_ids`` must be aligned with the signals' ``[B, T]`` positions.
    """
    a_res = signals.a_res if signals.has_residual else None
    return token_rows_from_batch(tokenizer, prompts, response_ids, signals.valid,
                                 signals.a_full, a_res, result.filtered, max_rows=max_rows,
                                 entropy_student=signals.entropy_student)


# ---- statistics -------------------------------------------------------------------------------

def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def rows_stats(rows: Sequence[TokenRow]) -> dict[str, float]:
    """The :func:`~saopd.filters.base.filter_stats` keys computed over the given rows only.

    Keys: ``flmr`` (Eq. 17), ``filtered_ratio``, ``n_valid``, ``n_filtered``, ``abs_a_filtered``,
    ``abs_a_kept`` and, when every row has A_res, ``grounding_gap_filtered`` /
    ``grounding_gap_kept``. Means over an empty set are 0.0.
    """
    a = [x for r in rows for x in r.a_full]
    f = [x for r in rows for x in r.filtered]
    abs_f = [abs(x) for x, m in zip(a, f, strict=True) if m]
    abs_k = [abs(x) for x, m in zip(a, f, strict=True) if not m]
    total = sum(abs_f) + sum(abs_k)
    stats = {
        "flmr": sum(abs_f) / (total + 1e-8),
        "filtered_ratio": len(abs_f) / len(a) if a else 0.0,
        "n_valid": float(len(a)),
        "n_filtered": float(len(abs_f)),
        "abs_a_filtered": _mean(abs_f),
        "abs_a_kept": _mean(abs_k),
    }
    if rows and all(r.a_res is not None for r in rows):
        gap = [g for r in rows for g in (r.gap or [])]
        stats["grounding_gap_filtered"] = _mean([g for g, m in zip(gap, f, strict=True) if m])
        stats["grounding_gap_kept"] = _mean([g for g, m in zip(gap, f, strict=True) if not m])
    return stats


# ---- rendering --------------------------------------------------------------------------------

def _fmt(v: float) -> str:
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e15):
        return str(int(v))
    return f"{v:.4g}"


def _colour(a: float, vmax: float) -> tuple[str, bool]:
    """Background ``#rrggbb`` for A_full on the diverging scale, and whether text goes white."""
    if not math.isfinite(a):
        a = math.copysign(vmax, a) if not math.isnan(a) else 0.0
    s = min(abs(a) / vmax, 1.0)
    end = _POS_RGB if a > 0 else _NEG_RGB
    rgb = tuple(round(m + (e - m) * s) for m, e in zip(_MID_RGB, end, strict=True))
    return "#{:02x}{:02x}{:02x}".format(*rgb), s > _LIGHT_TEXT_ABOVE


def _token_html(text: str, breaks: bool = True) -> str:
    """Escaped token text with newlines as ``↵<br>`` and control characters made visible.

    ``breaks=False`` leaves out the ``<br>`` (the annotated view puts it after the token box).
    """
    if text == "":
        return f'<span class="empty">{EMPTY_TOKEN_MARK}</span>'
    out = []
    for ch in text:
        if ch == "\n":
            out.append(f"{NEWLINE_MARK}<br>" if breaks else NEWLINE_MARK)
        elif ch == "\r":
            out.append(CARRIAGE_RETURN_MARK)
        elif ch != "\t" and (ord(ch) < 32 or ord(ch) == 127):
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(html.escape(ch))
    return "".join(out)


def _truncate(text: str, limit: int) -> str:
    """At most ``limit`` characters: head and tail kept, the middle replaced by `` … ``."""
    if limit <= 0 or len(text) <= limit:
        return text
    head = (limit + 1) // 2
    tail = limit - head
    return f"{text[:head]} \u2026 [{len(text) - limit} chars] \u2026 {text[len(text) - tail:]}"


def _auto_vmax(rows: Sequence[TokenRow]) -> float:
    """95th percentile of |A_full| over the shown tokens (robust to a few huge values)."""
    vals = sorted(abs(x) for r in rows for x in r.a_full if math.isfinite(x))
    if not vals:
        return 1.0
    v = vals[min(len(vals) - 1, math.ceil(0.95 * len(vals)) - 1)]
    return v if v > 1e-6 else max(vals[-1], 1.0)


def _stats_table(stats: dict[str, float]) -> str:
    keys = [k for k in _STAT_LABELS if k in stats] + [k for k in stats if k not in _STAT_LABELS]
    cells = "".join(
        f'<tr><th>{html.escape(_STAT_LABELS.get(k, k))}</th><td>{html.escape(_fmt(stats[k]))}</td>'
        "</tr>"
        for k in keys
    )
    return f'<table class="stats">{cells}</table>'


def _legend(vmax: float) -> str:
    lo = "#{:02x}{:02x}{:02x}".format(*_NEG_RGB)
    mid = "#{:02x}{:02x}{:02x}".format(*_MID_RGB)
    hi = "#{:02x}{:02x}{:02x}".format(*_POS_RGB)
    v = html.escape(f"{vmax:.3g}")
    return (
        '<div class="legend">'
        f'<div class="bar" style="background:linear-gradient(to right,{lo},{mid},{hi})"></div>'
        f'<div class="ticks"><span>&minus;{v}</span><span>0</span><span>+{v}</span></div>'
        '<p>Background: A<sub>full</sub> = log&#960;<sub>S</sub> &minus; log&#960;<sub>T</sub> of '
        'the sampled token. <b class="pos">Red</b>: A<sub>full</sub> &gt; 0, the teacher prefers '
        'the token less (student over-confident). <b class="neg">Blue</b>: '
        'A<sub>full</sub> &lt; 0, the teacher prefers it more. '
        f'Colours saturate at |A<sub>full</sub>| = {v}. '
        '<span class="flt-sample">outlined</span> = filtered (removed from the loss); '
        'no outline = kept. Hover a token for token | A_full | A_res | gap | filtered. '
        f'{NEWLINE_MARK} marks a newline.</p>'
        "</div>"
    )


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:1.5em;color:#222;
max-width:70em}
h1{font-size:1.3em;margin:0 0 .3em}
.meta{color:#555;margin:.2em 0}
table.stats{border-collapse:collapse;margin:.5em 0;font-size:.9em}
table.stats th{text-align:left;font-weight:normal;color:#555;padding:1px 1em 1px 0}
table.stats td{font-family:ui-monospace,monospace;padding:1px 0}
.legend{margin:.8em 0 1.2em;font-size:.85em;color:#444}
.legend .bar{width:18em;height:.9em;border:1px solid #999}
.legend .ticks{width:18em;display:flex;justify-content:space-between;
font-family:ui-monospace,monospace}
.legend .pos{color:#b2182b}.legend .neg{color:#2166ac}
.row{border-top:1px solid #ddd;padding:.8em 0}
.row h2{font-size:1em;margin:0 0 .3em;color:#333}
.prompt{white-space:pre-wrap;background:#f4f4f4;border-left:3px solid #bbb;padding:.4em .6em;
margin:.3em 0 .6em;font-size:.85em;color:#444;font-family:ui-monospace,monospace}
.resp{white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:.95em;line-height:1.9}
.tok{border-radius:2px}
.flt,.flt-sample{outline:2px solid #111;outline-offset:-1px}
.flt-sample{padding:0 .2em}
.empty{color:#999}
.resp.annotated{line-height:1.25}
.tok.ann{display:inline-flex;flex-direction:column;align-items:center;vertical-align:top;
margin:1px 1px 3px;padding:0 2px}
.tok.ann .tt{white-space:pre}
.tok.ann .av{font-size:.62em;line-height:1.15;opacity:.85;white-space:nowrap}
"""


def render_token_view(rows: list[TokenRow], *, title: str, stats: dict[str, float] | None = None,
                      step: int | None = None, filter_name: str | None = None,
                      vmax: float | None = None, max_prompt_chars: int = 400,
                      annotate: bool = False) -> str:
    """Render rows as one self-contained HTML page (inline CSS, no scripts or external assets).

    Args:
        rows: responses to show, e.g. from :func:`token_rows_from_batch`.
        title: page title and heading.
        stats: batch statistics to show in the header (``FilterResult.stats``: flmr,
            filtered_ratio, grounding_gap_filtered/kept, ...). ``None``: computed over ``rows``
            with :func:`rows_stats` and labelled as such.
        step: training step shown in the header.
        filter_name: filter shown in the header (e.g. ``"sa_opd"``).
        vmax: |A_full| at which colours saturate; default: 95th percentile over the shown tokens.
        max_prompt_chars: prompts longer than this are cut in the middle.
        annotate: also print each token's two values under it, as the paper's Appendix E
            figures do: ``F`` = A_full and ``Δ`` = the grounding gap |A_full - A_res| (``Δ n/a``
            without a residual pass). The token becomes a small box
            (``class="tok ann"``, text in ``.tt``, values in ``.av``); a newline token shows
            ``↵`` in its box and the line break follows the box.

    Every valid token is one ``<span class="tok">`` (``class="tok flt"`` when filtered), with a
    ``title`` attribute ``token | A_full | A_res | gap | filtered``, followed by
    `` | H_S <entropy>`` when the row carries the student entropy.
    """
    vmax = float(vmax) if vmax is not None and vmax > 0 else _auto_vmax(rows)
    header = [f"<h1>{html.escape(title)}</h1>"]
    if annotate:
        header.append('<div class="meta">under each token: F = A<sub>full</sub>, '
                      '&Delta; = grounding gap |A<sub>full</sub> &minus; A<sub>res</sub>|</div>')
    meta = []
    if step is not None:
        meta.append(f"step <b>{html.escape(str(step))}</b>")
    if filter_name is not None:
        meta.append(f"filter <b>{html.escape(filter_name)}</b>")
    meta.append(f"{len(rows)} response{'s' if len(rows) != 1 else ''} shown")
    header.append(f'<div class="meta">{" &middot; ".join(meta)}</div>')
    if stats is None:
        header.append('<div class="meta">statistics over the responses shown:</div>')
        header.append(_stats_table(rows_stats(rows)))
    else:
        header.append('<div class="meta">batch statistics:</div>')
        header.append(_stats_table(stats))
    header.append(_legend(vmax))

    body = []
    for i, row in enumerate(rows):
        gap = row.gap
        n_f = sum(row.filtered)
        rs = rows_stats([row])
        summary = (f"response {i} &middot; {len(row.tokens)} tokens &middot; {n_f} filtered "
                   f"&middot; FLMR {html.escape(_fmt(rs['flmr']))}")
        if "grounding_gap_filtered" in rs:
            g_f, g_k = _fmt(rs["grounding_gap_filtered"]), _fmt(rs["grounding_gap_kept"])
            summary += f" &middot; mean gap filtered {g_f} / kept {g_k}"
        spans = []
        for t, text in enumerate(row.tokens):
            a = row.a_full[t]
            bg, light = _colour(a, vmax)
            a_res = "n/a" if row.a_res is None else f"{row.a_res[t]:+.3f}"
            g = "n/a" if gap is None else f"{gap[t]:.3f}"
            flag = "filtered" if row.filtered[t] else "kept"
            tip = f"{text!r} | A_full {a:+.3f} | A_res {a_res} | gap {g} | {flag}"
            if row.entropy_student is not None:
                tip += f" | H_S {row.entropy_student[t]:.3f}"
            cls = "tok flt" if row.filtered[t] else "tok"
            style = f"background:{bg}" + (";color:#fff" if light else "")
            attrs = f'style="{style}" title="{html.escape(tip, quote=True)}"'
            if annotate:
                values = f"F {a:+.2f}<br>&Delta; " + ("n/a" if gap is None else f"{gap[t]:.2f}")
                spans.append(f'<span class="{cls} ann" {attrs}>'
                             f'<span class="tt">{_token_html(text, breaks=False)}</span>'
                             f'<span class="av">{values}</span></span>'
                             + "<br>" * text.count("\n"))
            else:
                spans.append(f'<span class="{cls}" {attrs}>{_token_html(text)}</span>')
        resp_cls = "resp annotated" if annotate else "resp"
        body.append(
            '<section class="row">'
            f"<h2>{summary}</h2>"
            f'<div class="prompt">{html.escape(_truncate(row.prompt, max_prompt_chars))}</div>'
            f'<div class="{resp_cls}">{"".join(spans)}</div>'
            "</section>"
        )

    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        + "\n".join(header) + "\n" + "\n".join(body) + "\n</body>\n</html>\n"
    )
