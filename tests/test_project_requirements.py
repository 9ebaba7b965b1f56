"""tools/project_requirements.py lists what saopd's install with the given extras requires (what
`make vllm-base` installs before the editable install), each once, and refuses an unknown
extra by name."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from packaging.requirements import Requirement

from saopd.paths import repo_root

TOOL = repo_root() / "tools" / "project_requirements.py"


def _run(*extras: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), *extras], capture_output=True, text=True,
                          timeout=60)


def test_the_dependencies_then_the_extras_requirements() -> None:
    base = _run().stdout.splitlines()
    dev = _run("dev").stdout.splitlines()
    names = [Requirement(line).name for line in dev]  # each line a valid requirement
    assert dev[:len(base)] == base and len(dev) > len(base)
    assert "lightning" in names and "mlflow" in names  # saopd's own
    assert "pytest" in names and "pytest" not in [Requirement(x).name for x in base]  # dev's
    assert "ray" not in names  # an extra not asked for
    assert len(set(dev)) == len(dev)


def test_a_requirement_in_two_places_is_listed_once() -> None:
    spec = importlib.util.spec_from_file_location("project_requirements", TOOL)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)  # the script's functions, without putting tools/ on sys.path
    project = {"dependencies": ["a>=1", "b"], "optional-dependencies": {"x": ["b", "c"]}}
    assert tool.requirements(project, ["x"]) == ["a>=1", "b", "c"]


def test_an_unknown_extra_is_named() -> None:
    res = _run("dev", "gpu")
    assert res.returncode == 1 and res.stdout == ""
    assert "no extra gpu in pyproject.toml (it has: data, dev, ray)" in res.stderr
