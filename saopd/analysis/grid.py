"""The grid shared by the results and token-statistics tables: one format-independent
:class:`Grid` of marked :class:`Cell` s, turned into one pandas table object
(:func:`grid_styler`, a :class:`~pandas.io.formats.style.Styler` over the cells' display strings
with the marks as cell CSS) and rendered by library routines: GitHub Markdown
(:meth:`DataFrame.to_markdown`, i.e. tabulate), a booktabs LaTeX table
(:meth:`Styler.to_latex`) or an HTML table (:meth:`Styler.to_html`; inline CSS, no scripts)."""

from __future__ import annotations

import hashlib
import html
from dataclasses import dataclass, field
from typing import Literal

import pandas as pd
from pandas.io.formats.style import Styler

__all__ = ["Cell", "Grid", "Mark", "grid_html", "grid_latex", "grid_markdown", "grid_styler",
           "latex_escape"]

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
            HTML class ``rule``); Markdown has none.
        row_classes: a CSS class per row for HTML (``reference``, ``method``, ``highlight``,
            ``delta``, ``section``); a ``section`` row shows only its (italic) label.
        caption: shown above the table.
        notes: lines printed under the table.
    """

    header: list[str]
    rows: list[list[Cell]]
    rules: set[int] = field(default_factory=set)
    row_classes: list[str] = field(default_factory=list)
    caption: str | None = None
    notes: list[str] = field(default_factory=list)


# a mark's cell CSS: Styler.to_html keeps it; Styler.to_latex(convert_css=True) turns
# font-weight into \bfseries and font-style into \itshape, and takes the "--latex" property
# (which browsers ignore) as the command \underline{...}
_MARK_CSS = {"best": "font-weight: bold;",
             "second": "text-decoration: underline; underline: --rwrap --latex;"}
_SECTION_CSS = "font-style: italic;"


def _frames(grid: Grid) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The cells' texts and marks, one row per grid row, columns by position (headers repeat)."""
    width = len(grid.header)
    texts, marks = [], []
    for i, row in enumerate(grid.rows):
        if grid.row_classes and grid.row_classes[i] == "section":
            row = [Cell(row[0].text)] + [Cell("")] * (width - 1)
        texts.append([c.text for c in row])
        marks.append([c.mark for c in row])
    return pd.DataFrame(texts, columns=range(width)), pd.DataFrame(marks, columns=range(width))


def _sections(grid: Grid) -> list[int]:
    return [i for i, c in enumerate(grid.row_classes) if c == "section"]


def grid_styler(grid: Grid) -> Styler:
    """The grid as one pandas ``Styler``: the cells' texts (its ``data``), the marks as cell CSS,
    the row classes (and ``rule``) as ``<td>`` classes, the headers in bold, no index. Each
    renderer below adds its own escaping (``Styler.format``) and caption."""
    texts, marks = _frames(grid)
    css = marks.map(lambda m: _MARK_CSS.get(m, ""))
    for i in _sections(grid):
        css.iloc[i, 0] = _SECTION_CSS
    classes = pd.DataFrame("", index=texts.index, columns=texts.columns)
    for i in range(len(grid.rows)):
        names = [grid.row_classes[i]] if grid.row_classes else []
        names += ["rule"] if i in grid.rules and i > 0 else []
        classes.iloc[i, :] = " ".join(names)
    # ids (and so the CSS of the marks) that differ between tables and repeat between runs
    uuid = hashlib.blake2s(repr((grid.header, grid.rows)).encode(), digest_size=4).hexdigest()
    return (texts.style.hide(axis="index").set_uuid(uuid)
            .set_table_attributes('class="results"')
            .apply(lambda _: css, axis=None).set_td_classes(classes)
            .map_index(lambda _: "font-weight: bold;", axis="columns"))


def grid_markdown(grid: Grid) -> str:
    """GitHub Markdown (tabulate's ``pipe`` format): bold as ``**x**``, underline as
    ``<u>x</u>`` (Markdown has none), a section row as its ``*label*``; ``|`` is escaped."""
    texts, marks = _frames(grid)
    cells = texts.map(lambda t: t.replace("|", "\\|"))
    cells = cells.mask(marks == "best", "**" + cells + "**")
    cells = cells.mask(marks == "second", "<u>" + cells + "</u>")
    for i in _sections(grid):
        cells.iloc[i, 0] = f"*{cells.iloc[i, 0]}*"
    table = cells.to_markdown(index=False, headers=[h.replace("|", "\\|") for h in grid.header],
                              colalign=["left"] + ["right"] * (len(grid.header) - 1),
                              disable_numparse=True)
    lines = [grid.caption, ""] if grid.caption else []
    lines.append(table)
    if grid.notes:
        lines += [""] + [f"{n}  " for n in grid.notes]
    return "\n".join(lines) + "\n"


_LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#",
                  "_": r"\_", "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}",
                  "^": r"\textasciicircum{}", "±": r"$\pm$", "Δ": r"$\Delta$", "–": "--",
                  "\n": " "}


def latex_escape(text: str) -> str:
    """Escape LaTeX's special characters (``±`` and ``Δ`` become math, which pandas' own
    ``escape="latex"`` leaves as they are)."""
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def grid_latex(grid: Grid, *, label: str | None = None) -> str:
    """A booktabs ``table`` (``\\usepackage{booktabs}``) from ``Styler.to_latex``: bold as
    ``\\bfseries``, underline as ``\\underline``, ``\\midrule`` before the grid's rules."""
    styler = (grid_styler(grid).format(latex_escape)
              .format_index(lambda i: latex_escape(grid.header[i]), axis="columns"))
    if grid.caption:
        styler.set_caption(latex_escape(grid.caption))
    tex = styler.to_latex(convert_css=True, hrules=True, environment="table", position="t",
                          position_float="centering", label=label,
                          column_format="l" + "c" * (len(grid.header) - 1))
    # Styler draws booktabs rules only around the header and body: a rule between groups of
    # rows goes before that row's line (one line per row: latex_escape removes newlines)
    lines = tex.splitlines()
    body = lines.index(r"\midrule") + 1
    for i in sorted((i for i in grid.rules if i > 0), reverse=True):
        lines.insert(body + i, r"\midrule")
    lines += [f"% {note}" for note in grid.notes]
    return "\n".join(lines) + "\n"


_HTML_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:1.5em;color:#222}
table.results{border-collapse:collapse;margin:.6em 0;font-variant-numeric:tabular-nums}
table.results caption{caption-side:top;text-align:left;font-weight:600;padding-bottom:.4em}
table.results th,table.results td{padding:.25em .7em;text-align:center;white-space:nowrap}
table.results th:first-child,table.results td:first-child{text-align:left}
table.results thead th{border-top:2px solid #222;border-bottom:1px solid #222}
table.results tbody tr:last-child td{border-bottom:2px solid #222}
table.results td.rule{border-top:1px solid #222}
table.results td.highlight{background:#dcebff}
table.results td.reference{color:#555}
table.results td.delta{font-size:.9em;color:#333}
table.results td.section{background:#f2f2f2}
table.results td{text-decoration-thickness:1px;text-underline-offset:2px}
p.note{color:#555;font-size:.85em;margin:.2em 0}
"""


def grid_html(grid: Grid, *, title: str | None = None, standalone: bool = True) -> str:
    """An HTML ``<table class="results">`` from ``Styler.to_html``: marks as cell CSS
    (``font-weight: bold``, ``text-decoration: underline``), row classes on the ``<td>`` s, no
    scripts; ``standalone`` wraps it in a complete page. Every text is escaped."""
    styler = (grid_styler(grid).format(escape="html")
              .format_index(lambda i: html.escape(grid.header[i]), axis="columns"))
    if grid.caption:
        styler.set_caption(html.escape(grid.caption))
    table = styler.to_html().strip()
    table += "".join(f'\n<p class="note">{html.escape(n)}</p>' for n in grid.notes)
    if not standalone:
        return table + "\n"
    head_title = html.escape(title or grid.caption or "saopd report")
    heading = f"<h1>{html.escape(title)}</h1>\n" if title else ""
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{head_title}</title>\n<style>{_HTML_CSS}</style>\n</head>\n<body>\n"
            f"{heading}{table}\n</body>\n</html>\n")
