"""The documentation: the site builds strictly (no broken link, missing anchor or page left out of
the navigation), the README is a front page whose links and commands exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import REPO

README = REPO / "README.md"


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                          "--site-dir", str(site)], cwd=REPO, capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "WARNING" not in out.stderr
    for page in ("index.html", "training/index.html", "studies/index.html",
                 "tracking/index.html", "api/filters/index.html"):
        assert (site / page).is_file(), page
    # mkdocstrings rendered the pure layer's API from the sources
    api = (site / "api" / "filters" / "index.html").read_text(encoding="utf-8")
    assert "spurious_token_mask" in api and "SAOPDFilter" in api


def test_every_manual_page_is_in_the_navigation() -> None:
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())

    def pages(node: object) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, dict):
            return [p for v in node.values() for p in pages(v)]
        return [p for v in node for p in pages(v)] if isinstance(node, list) else []

    in_nav = set(pages(config["nav"]))
    on_disk = {p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")}
    assert not on_disk - in_nav, f"pages missing from mkdocs.yml's nav: {sorted(on_disk - in_nav)}"
    assert not in_nav - on_disk, f"nav entries without a page: {sorted(in_nav - on_disk)}"


def test_the_readme_is_a_front_page_whose_links_exist() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.encode()) <= 10_000
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if not t.startswith(("http://", "https://"))]
    assert local, "the README links to the manual"
    for target in local:
        assert (REPO / target).is_file(), target
    # the two commands it starts with are Makefile targets
    makefile = (REPO / "Makefile").read_text()
    for command in re.findall(r"^make (\w[\w-]*)", text, flags=re.M):
        assert re.search(rf"^{re.escape(command)}:", makefile, flags=re.M), command
    assert text.count("```bash\nmake run ") == 1
