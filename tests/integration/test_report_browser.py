"""The report's HTML table as a browser shows it: headless Chromium (Debian's ``chromium``).

Install it with ``make browser``; without it these tests skip and say so.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from saopd.analysis.tables import results_table
from tests.analysis.rendered import html_cells

CHROMIUM = shutil.which("chromium") or (
    "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium is not installed (no `chromium` on PATH or at "
    "/usr/bin/chromium); `make browser` installs it")

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
METHODS = {"OPD": (0.62, 0.10), "ExOPD": (0.65, 0.14), "TIP": (0.68, 0.13),
           "SA-OPD": (0.70, 0.15)}


def _chromium(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={tmp / 'profile'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    scores = pd.DataFrame({"eval/math500/avg_at_1": {m: v[0] for m, v in METHODS.items()},
                           "eval/aime24/avg_at_8": {m: v[1] for m, v in METHODS.items()}})
    labels = pd.Series({m: m for m in METHODS})
    table = results_table(scores, {"eval/math500/avg_at_1": "Math500",
                                   "eval/aime24/avg_at_8": "AIME24"}, labels=labels,
                          caption="Math reasoning")
    path = tmp_path_factory.mktemp("page") / "results.html"
    path.write_text(table.to_html(title="Results"), encoding="utf-8")
    return path


def test_dom_holds_the_table_rows(page: Path, tmp_path: Path) -> None:
    dom = _chromium(tmp_path, "--dump-dom", page.as_uri()).stdout
    header, *rows = html_cells(dom)  # (text, the CSS of the cell's id) per cell
    assert [t for t, _ in header[:4]] == ["Method", "Math500", "AIME24", "Avg."]
    names = [r[0][0] for r in rows]
    assert names[:len(METHODS)] == ["OPD", "ExOPD", "TIP", "SA-OPD"]
    sa = rows[names.index("SA-OPD")]
    assert sa[1][0] == f"{100 * METHODS['SA-OPD'][0]:.1f}"
    # SA-OPD is best on every column here: its benchmark and Avg. cells are the bold ones
    bold = {(i, j) for i, row in enumerate(rows) for j, (_, css) in enumerate(row)
            if "font-weight: bold" in css}
    i = names.index("SA-OPD")
    assert {(i, 1), (i, 2), (i, 3)} <= bold and all(r == i for r, _ in bold)
    assert "Δ over OPD" in names


def test_screenshot_is_not_blank(page: Path, tmp_path: Path) -> None:
    shot = tmp_path / "shot.png"
    _chromium(tmp_path, f"--screenshot={shot}", "--window-size=900,500", page.as_uri())
    with Image.open(shot) as im:
        assert im.size == (900, 500)
        pixels = np.asarray(im.convert("L"), dtype=float)
    dark = pixels < 100
    assert dark.mean() > 0.003  # text and rules were drawn
    rows_with_ink = np.flatnonzero(dark.any(axis=1))
    assert rows_with_ink.max() - rows_with_ink.min() > 100  # several lines of the table
    assert (pixels[:, :450] < 100).mean() > (pixels[:, 850:] < 100).mean()  # left-aligned page
