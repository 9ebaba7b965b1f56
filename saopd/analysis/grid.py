"""A small grid renderer shared by the results and token-statistics tables: one
format-independent :class:`Grid` of marked :class:`Cell` s, rendered as GitHub Markdown, a
booktabs LaTeX table or an HTML table (inline CSS, no scripts)."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Cell", "Grid", "Mark", "grid_html", "grid_latex", "grid_markdown", "latex_escape"]

Mark = Literal["", "best", "second"]


@dataclass
class Cell:
    """One table cell: its text and its mark (``best`` = bold, ``second`` = underlined)."""

    text: str
    mark: Mark = ""


@dataclass
class Grid:
    """A rendered table, independent of the output format.

    Attributes:
        header: column headers, the first one over the row labels.
        rows: cells of each row; the first cell is the row label.
        rules: row indices before which a horizontal rule is drawn (LaTeX ``\\midrule``,
            HTML ``class="rule"``); Markdown has none.
        row_classes: a CSS class per row for HTML (``reference``, ``method``, ``highlight``,
            ``delta``, ``section``).
        caption: shown above (HTML, Markdown) or below (LaTeX) the table.
        notes: lines printed under the table.
    """

    header: list[str]
    rows: list[list[Cell]]
    rules: set[int] = field(default_factory=set)
    row_classes: list[str] = field(default_factory=list)
    caption: str | None = None
    notes: list[str] = field(default_factory=list)


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def grid_markdown(grid: Grid) -> str:
    """GitHub Markdown: bold as ``**x**``, underline as ``<u>x</u>`` (Markdown has none)."""
    def cell(c: Cell) -> str:
        t = _md_escape(c.text)
        if c.mark == "best":
            return f"**{t}**"
        if c.mark == "second":
            return f"<u>{t}</u>"
        return t

    lines = []
    if grid.caption:
        lines += [grid.caption, ""]
    lines.append("| " + " | ".join(_md_escape(h) for h in grid.header) + " |")
    lines.append("|" + "|".join([":---"] + ["---:"] * (len(grid.header) - 1)) + "|")
    for i, row in enumerate(grid.rows):
        cells = [cell(c) for c in row]
        if grid.row_classes and grid.row_classes[i] == "section":
            cells = [f"*{cells[0]}*"] + [""] * (len(grid.header) - 1)
        lines.append("| " + " | ".join(cells) + " |")
    if grid.notes:
        lines.append("")
        lines += [f"{n}  " for n in grid.notes]
    return "\n".join(lines) + "\n"


_LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#",
                  "_": r"\_", "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}",
                  "^": r"\textasciicircum{}", "±": r"$\pm$", "Δ": r"$\Delta$", "–": "--"}


def latex_escape(text: str) -> str:
    """Escape LaTeX's special characters (``±`` and ``Δ`` become math)."""
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def grid_latex(grid: Grid, *, label: str | None = None) -> str:
    """A booktabs ``table`` (``\\usepackage{booktabs}``): ``\\textbf`` / ``\\underline``."""
    def cell(c: Cell) -> str:
        t = latex_escape(c.text)
        if c.mark == "best":
            return rf"\textbf{{{t}}}"
        if c.mark == "second":
            return rf"\underline{{{t}}}"
        return t

    cols = "l" + "c" * (len(grid.header) - 1)
    lines = [r"\begin{table}[t]", r"\centering", rf"\begin{{tabular}}{{{cols}}}", r"\toprule",
             " & ".join(rf"\textbf{{{latex_escape(h)}}}" for h in grid.header) + r" \\",
             r"\midrule"]
    for i, row in enumerate(grid.rows):
        if i in grid.rules and i > 0:
            lines.append(r"\midrule")
        if grid.row_classes and grid.row_classes[i] == "section":
            lines.append(rf"\multicolumn{{{len(grid.header)}}}{{l}}"
                         rf"{{\textit{{{latex_escape(row[0].text)}}}}} \\")
            continue
        lines.append(" & ".join(cell(c) for c in row) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    if grid.caption:
        lines.append(rf"\caption{{{latex_escape(grid.caption)}}}")
    if label:
        lines.append(rf"\label{{{label}}}")
    lines.append(r"\end{table}")
    for note in grid.notes:
        lines.append(f"% {note}")
    return "\n".join(lines) + "\n"


_HTML_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:1.5em;color:#222}
table.results{border-collapse:collapse;margin:.6em 0;font-variant-numeric:tabular-nums}
table.results caption{caption-side:top;text-align:left;font-weight:600;padding-bottom:.4em}
table.results th,table.results td{padding:.25em .7em;text-align:center;white-space:nowrap}
table.results th:first-child,table.results td:first-child{text-align:left}
table.results thead th{border-top:2px solid #222;border-bottom:1px solid #222}
table.results tbody tr:last-child td{border-bottom:2px solid #222}
table.results tr.rule td{border-top:1px solid #222}
table.results tr.highlight td{background:#dcebff}
table.results tr.reference td{color:#555}
table.results tr.delta td{font-size:.9em;color:#333}
table.results tr.section td{font-style:italic;background:#f2f2f2}
table.results u{text-decoration-thickness:1px;text-underline-offset:2px}
p.note{color:#555;font-size:.85em;margin:.2em 0}
"""


def grid_html(grid: Grid, *, title: str | None = None, standalone: bool = True) -> str:
    """An HTML ``<table class="results">`` (``<b>`` / ``<u>`` marks), inline CSS, no scripts;
    ``standalone`` wraps it in a complete page. Every text is escaped."""
    def cell(c: Cell, tag: str) -> str:
        t = html.escape(c.text)
        if c.mark == "best":
            t = f"<b>{t}</b>"
        elif c.mark == "second":
            t = f"<u>{t}</u>"
        return f"<{tag}>{t}</{tag}>"

    parts = ['<table class="results">']
    if grid.caption:
        parts.append(f"<caption>{html.escape(grid.caption)}</caption>")
    parts.append("<thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in grid.header)
                 + "</tr></thead>")
    parts.append("<tbody>")
    for i, row in enumerate(grid.rows):
        classes = []
        if grid.row_classes:
            classes.append(grid.row_classes[i])
        if i in grid.rules and i > 0:
            classes.append("rule")
        attr = f' class="{" ".join(classes)}"' if classes else ""
        if grid.row_classes and grid.row_classes[i] == "section":
            parts.append(f'<tr{attr}><td colspan="{len(grid.header)}">'
                         f"{html.escape(row[0].text)}</td></tr>")
            continue
        parts.append(f"<tr{attr}>" + cell(row[0], "td")
                     + "".join(cell(c, "td") for c in row[1:]) + "</tr>")
    parts.append("</tbody></table>")
    parts += [f'<p class="note">{html.escape(n)}</p>' for n in grid.notes]
    table = "\n".join(parts)
    if not standalone:
        return table + "\n"
    head_title = html.escape(title or grid.caption or "saopd report")
    heading = f"<h1>{html.escape(title)}</h1>\n" if title else ""
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{head_title}</title>\n<style>{_HTML_CSS}</style>\n</head>\n<body>\n"
            f"{heading}{table}\n</body>\n</html>\n")
