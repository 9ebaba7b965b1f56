"""tools/pyproject_requirements.py: the requirements the Makefile installs before saopd's
editable install are pyproject.toml's, with the extras asked for, and a mistyped extra is named
(pip itself only warns about one)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ (the tool reads pyproject.toml)")

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "pyproject_requirements.py"


def _run(spec: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), spec], capture_output=True, text=True,
                          timeout=60)


def test_the_spec_of_each_venv_lists_the_projects_and_its_extras_requirements() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    base = _run(".")
    assert base.returncode == 0, base.stderr
    assert base.stdout.split("\n")[:-1] == project["dependencies"]
    main = _run(".[dev,ray]")
    assert main.returncode == 0, main.stderr
    assert main.stdout.split("\n")[:-1] == [*project["dependencies"], *extras["dev"],
                                            *extras["ray"]]


def test_a_repeated_requirement_is_listed_once(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\ndependencies = ["a>=1", "b"]\n'
                         '[project.optional-dependencies]\nx = ["b", "c"]\n')
    spec = importlib.util.spec_from_file_location("pyproject_requirements", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.requirements(".[x]", pyproject) == ["a>=1", "b", "c"]


def test_an_unknown_extra_or_a_malformed_spec_is_named() -> None:
    unknown = _run(".[dev,rya]")
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert "defines no extra 'rya' (it has data, dev, ray)" in unknown.stderr
    malformed = _run("saopd[dev]")
    assert malformed.returncode == 2
    assert "'saopd[dev]': expected '.' or '.[extra,...]'" in malformed.stderr
