"""Reading rendered grids back in tests: Markdown rows, and HTML cells with the CSS that the
page's ``<style>`` block gives each (``Styler.to_html`` marks cells by id)."""

from __future__ import annotations

import re
from html.parser import HTMLParser


def md_rows(markdown: str) -> dict[str, list[str]]:
    """The table's rows by their (stripped) first cell, each as its stripped cells."""
    rows: dict[str, list[str]] = {}
    for line in markdown.splitlines():
        if line.startswith("|") and not line.startswith("|:"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            rows.setdefault(cells[0], cells)
    return rows


class _Cells(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[tuple[str, str]]] = []  # (text, id) per cell
        self.style = ""
        self._in_style = False
        self._cell: list[str] | None = None
        self._id = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "style":
            self._in_style = True
        elif tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell, self._id = [], dict(attrs).get("id") or ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "style":
            self._in_style = False
        elif tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append(("".join(self._cell).strip(), self._id))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self.style += data
        elif self._cell is not None:
            self._cell.append(data)


def html_cells(page: str) -> list[list[tuple[str, str]]]:
    """Each ``<tr>``'s cells as (text, the CSS declarations of the cell's id)."""
    parser = _Cells()
    parser.feed(page)
    css: dict[str, str] = {}
    for selectors, body in re.findall(r"([^{}]+)\{([^{}]*)\}", parser.style):
        for sel in selectors.split(","):
            if sel.strip().startswith("#"):
                css[sel.strip()[1:]] = css.get(sel.strip()[1:], "") + body.strip()
    return [[(text, css.get(i, "")) for text, i in row] for row in parser.rows]


def html_rows(page: str) -> dict[str, list[tuple[str, str]]]:
    """:func:`html_cells` by each row's first cell."""
    rows: dict[str, list[tuple[str, str]]] = {}
    for row in html_cells(page):
        if row:
            rows.setdefault(row[0][0], row)
    return rows
