"""``saopd-train --help`` lists as choices only what can be chosen: every engine of the rollout
registry, and none of the typed schemas (issue 29; they are stored outside the groups)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from saopd.rollout import ENGINES


def _groups(module: str) -> dict[str, list[str]]:
    """``group: [choices]`` from the "Configuration groups" section of ``module``'s ``--help``."""
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    section = out.stdout.split("== Configuration groups ==", 1)[1].split("== Config ==", 1)[0]
    groups = {}
    for line in section.splitlines():
        name, sep, choices = line.partition(": ")
        if sep and name and " " not in name:
            groups[name] = choices.split(", ")
    return groups


@pytest.mark.parametrize("module", ["saopd.train", "saopd.evaluate"])
def test_help_lists_the_engines_and_no_schema(module: str) -> None:
    groups = _groups(module)
    assert groups["rollout"] == ENGINES.names()
    for name, choices in groups.items():
        assert not [c for c in choices if c.endswith("_schema")], (name, choices)
