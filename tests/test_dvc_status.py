"""``dvc status`` of the repository is clean as a fresh clone can be: ``dvc.lock`` records the
current hash of every stage's code, data and params, and the outputs kept in git are the ones it
records. What a fresh clone lacks is allowed: the outputs of the stages cached by DVC (the
prepared benchmarks and prompts, git-ignored) are made by ``make data`` and show as ``not in
cache`` or ``deleted`` until then. Anything else (a dependency changed since the lock was
written, a param, a command, an output in git or in the workspace that differs) fails: it means
``dvc repro`` would re-run a stage. After changing a stage's dependency, run ``dvc repro
<stage>`` and commit ``dvc.lock`` (and say so if its outputs changed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
#: ``dvc status`` says these of an output that was never built here (nothing in the workspace).
NOT_BUILT = ("not in cache", "deleted")


def _dvc() -> str:
    beside = Path(sys.executable).parent / "dvc"
    found = str(beside) if beside.is_file() else shutil.which("dvc")
    if found is None or shutil.which("git") is None:
        pytest.skip("dvc or git is not installed")
    return found


def dvc_status(cwd: Path, *stages: str) -> dict[str, Any]:
    """``dvc status --json [stages]`` in ``cwd``, parsed (offline: no remote is asked)."""
    env = {**os.environ, "DVC_NO_ANALYTICS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    res = subprocess.run([_dvc(), "status", "--json", *stages], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout or "{}")


def _in_git(cwd: Path, path: str) -> bool:
    """Whether git tracks ``path`` (a file, or files under a folder) in ``cwd``'s repository."""
    res = subprocess.run(["git", "ls-files", "--", path], cwd=cwd, capture_output=True,
                         text=True, timeout=60, check=True)
    return bool(res.stdout.strip())


def status_problems(status: dict[str, Any], cwd: Path) -> list[str]:
    """What in ``status`` (:func:`dvc_status`'s result) a fresh clone must not show, one line
    each: any change but a DVC-cached output that was never built (:data:`NOT_BUILT`, and not in
    git)."""
    problems = []
    for stage, changes in status.items():
        for change in changes:
            if not isinstance(change, dict):  # e.g. "changed checksum", "always changed"
                problems.append(f"{stage}: {change}")
                continue
            for kind, paths in change.items():
                items = paths.items() if isinstance(paths, dict) else [(str(paths), kind)]
                for path, state in items:
                    built_later = (kind == "changed outs" and state in NOT_BUILT
                                   and not _in_git(cwd, path))
                    if not built_later:
                        problems.append(f"{stage}: {kind}: {path}: {state}")
    return problems


def test_dvc_status_is_clean_but_for_outputs_not_built() -> None:
    problems = status_problems(dvc_status(REPO), REPO)
    assert not problems, ("dvc.lock does not describe the repository (run `dvc repro` on these "
                          "stages and commit dvc.lock):\n" + "\n".join(problems))


def test_a_stale_dependency_hash_is_reported(tmp_path: Path) -> None:
    """The check above fails when ``dvc.lock`` holds an old hash of a stage's code: a copy of
    ``prepare_train``'s files is clean with the repository's lock and reported once one dep's
    recorded md5 is changed; its outputs, never built in the copy, are not reported."""
    lock = yaml.safe_load((REPO / "dvc.lock").read_text())
    stage = lock["stages"]["prepare_train"]
    work = tmp_path / "repo"
    for rel in ("dvc.yaml", "params.yaml", ".dvcignore", ".dvc/config", ".dvc/.gitignore",
                *(dep["path"] for dep in stage["deps"])):
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, work / rel)
    shutil.copy2(REPO / "dvc.lock", work / "dvc.lock")
    subprocess.run(["git", "init", "-q"], cwd=work, check=True, timeout=60)

    assert status_problems(dvc_status(work, "prepare_train"), work) == []

    code = next(dep for dep in stage["deps"] if dep["path"] == "saopd/prompts/text.py")
    code["md5"] = "0" * 32  # the lock of an older text.py
    (work / "dvc.lock").write_text(yaml.safe_dump(lock, sort_keys=False))
    problems = status_problems(dvc_status(work, "prepare_train"), work)
    assert problems == ["prepare_train: changed deps: saopd/prompts/text.py: modified"], problems
