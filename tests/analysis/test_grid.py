"""The grid's three renderings (Markdown, LaTeX, HTML) from one pandas table object."""

from __future__ import annotations

import re

from saopd.analysis.grid import Cell, Grid, grid_html, grid_latex, grid_markdown, grid_styler
from tests.analysis.rendered import html_cells, md_rows


def _grid() -> Grid:
    return Grid(
        header=["Method", "Acc_1 (%)", "Ratio", "Ratio"],
        rows=[[Cell("Reference")] + [Cell("")] * 3,
              [Cell("student_0 #1"), Cell("30.0"), Cell("a|b"), Cell("<i>")],
              [Cell("SA-OPD 50% & co"), Cell("62.0 ± 1.0", "best"), Cell("7", "second"),
               Cell("3")],
              [Cell("Δ over OPD"), Cell("+1.0"), Cell("–"), Cell("9", "best")]],
        rules={0, 1, 2}, row_classes=["section", "reference", "highlight", "delta"],
        caption="Scores_in % <b>", notes=["mean ± CI_95 <x>"])


def test_markdown_marks_exactly_the_marked_cells() -> None:
    md = grid_markdown(_grid())
    assert md.startswith("Scores_in % <b>\n\n| Method")
    rows = md_rows(md)
    assert rows["Method"] == ["Method", "Acc_1 (%)", "Ratio", "Ratio"]
    assert rows["*Reference*"][1:] == ["", "", ""]
    assert rows["student_0 #1"] == ["student_0 #1", "30.0", r"a\|b", "<i>"]  # | escaped
    assert rows["SA-OPD 50% & co"][1:] == ["**62.0 ± 1.0**", "<u>7</u>", "3"]
    assert rows["Δ over OPD"][1:] == ["+1.0", "–", "**9**"]
    assert md.count("**") == 4 and md.count("<u>") == 1
    assert re.search(r"^\|:-+\|-+:\|-+:\|-+:\|$", md, re.M)  # labels left, values right
    assert md.rstrip().endswith("mean ± CI_95 <x>")


def test_latex_is_a_booktabs_table_with_escaped_text_and_marks() -> None:
    tex = grid_latex(_grid(), label="tab:x")
    order = [r"\begin{table}[t]", r"\centering", r"\caption{Scores\_in \% <b>}",
             r"\label{tab:x}", r"\begin{tabular}{lccc}", r"\toprule", r"\midrule",
             r"\bottomrule", r"\end{tabular}", r"\end{table}", "% mean ± CI_95 <x>"]
    at = [tex.index(s) for s in order]
    assert at == sorted(at)
    lines = tex.splitlines()
    body = lines[lines.index(r"\toprule") + 1:lines.index(r"\bottomrule")]
    assert body[0] == (r"\bfseries Method & \bfseries Acc\_1 (\%) & \bfseries Ratio & "
                       r"\bfseries Ratio \\")
    # the header rule, then a rule before each of rows 1 and 2 (rules at 0 draw nothing)
    assert body[1:] == [
        r"\midrule",
        r"\itshape Reference &  &  &  \\",
        r"\midrule",
        r"student\_0 \#1 & 30.0 & a|b & <i> \\",
        r"\midrule",
        r"SA-OPD 50\% \& co & \bfseries 62.0 $\pm$ 1.0 & \underline{7} & 3 \\",
        r"$\Delta$ over OPD & +1.0 & -- & \bfseries 9 \\",
    ]
    assert tex.count(r"\bfseries") == 4 + 2 and tex.count(r"\underline") == 1


def test_html_styles_exactly_the_marked_cells_and_escapes_text() -> None:
    page = grid_html(_grid(), title="Results <1>")
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page
    assert "<title>Results &lt;1&gt;</title>" in page and "<h1>Results &lt;1&gt;</h1>" in page
    assert "<caption>Scores_in % &lt;b&gt;</caption>" in page
    assert '<p class="note">mean ± CI_95 &lt;x&gt;</p>' in page
    assert "&lt;i&gt;" in page and "<i>" not in page
    head, *rows = html_cells(page)
    assert [t for t, _ in head] == ["Method", "Acc_1 (%)", "Ratio", "Ratio"]
    bold = {(r, c) for r, row in enumerate(rows) for c, (_, css) in enumerate(row)
            if "font-weight: bold" in css}
    under = {(r, c) for r, row in enumerate(rows) for c, (_, css) in enumerate(row)
             if "text-decoration: underline" in css}
    assert bold == {(2, 1), (3, 3)} and under == {(2, 2)}
    assert rows[2][1][0] == "62.0 ± 1.0" and rows[1][3][0] == "<i>"
    # row classes and rules on the cells, for the page's stylesheet
    assert re.search(r'<td id="\w+_row2_col0" class="data row2 col0 highlight rule"', page)
    assert re.search(r'<td id="\w+_row0_col0" class="data row0 col0 section"', page)
    table = grid_html(_grid(), standalone=False)
    assert table.startswith("<style") and "<html" not in table


def test_one_styler_behind_the_renderings() -> None:
    grid = _grid()
    styler = grid_styler(grid)
    assert styler.data.shape == (4, 4) and styler.data.iat[2, 1] == "62.0 ± 1.0"
    assert styler.data.iloc[0, 1:].tolist() == ["", "", ""]  # a section row: its label only
    # the ids that carry a cell's marks repeat between runs and differ between tables
    assert grid_html(grid) == grid_html(_grid())
    other = Grid(header=grid.header, rows=grid.rows[1:])
    uuid = re.search(r'<table id="(\w+)"', grid_html(grid)).group(1)
    assert uuid not in grid_html(other)
