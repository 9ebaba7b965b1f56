"""tools/compile_bytecode.py: every module under a folder gets the .pyc Python would write, one
this Python cannot compile is named and left, a .pyc that cannot be written fails the run with
its path, and a second run compiles only what changed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "compile_bytecode.py"


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # only the tool may write a .pyc
    return subprocess.run([sys.executable, str(TOOL), "--jobs", "2", *map(str, args)],
                          capture_output=True, text=True, timeout=120, env=env)


def _tree(root: Path) -> dict[str, Path]:
    files = {"top": root / "top.py", "nested": root / "pkg" / "sub" / "mod.py",
             "init": root / "pkg" / "__init__.py", "bad": root / "pkg" / "newer_python.py"}
    for name, path in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("def f(:\n" if name == "bad" else f"VALUE = {name!r}\n")
    (root / "notes.txt").write_text("not python")
    return files


def _value(root: Path, module: str) -> str:
    """``module``'s VALUE as a fresh process imports it (``-B``: it writes no bytecode)."""
    out = subprocess.run([sys.executable, "-B", "-c",
                          f"import sys; sys.path.insert(0, {str(root)!r}); import {module} as m; "
                          "print(m.VALUE)"],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def test_compiles_every_module_names_the_invalid_one_and_skips_fresh_ones(tmp_path: Path) -> None:
    files = _tree(tmp_path)
    out = _run(tmp_path)
    assert out.returncode == 0, out.stderr
    assert "3 compiled, 0 already up to date, 1 not valid Python" in out.stdout
    assert "of 4 files" in out.stdout
    assert f"not compiled (SyntaxError): {files['bad']}" in out.stdout
    for name in ("top", "nested", "init"):
        assert Path(importlib.util.cache_from_source(str(files[name]))).is_file(), name
    assert not Path(importlib.util.cache_from_source(str(files["bad"]))).exists()

    # the .pyc is the one the import system trusts: a source edited to the same size and mtime
    # is not read again, so the value comes from the compiled file
    source = files["nested"]
    stat = source.stat()
    source.write_text("VALUE = 'NESTED'\n")
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert _value(tmp_path, "pkg.sub.mod") == "nested"
    source.write_text("VALUE = 'nested'\n")
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    again = _run(tmp_path)
    assert again.returncode == 0, again.stderr
    assert "0 compiled, 3 already up to date" in again.stdout

    files["top"].write_text("VALUE = 'changed, and longer than before'\n")
    changed = _run(tmp_path)
    assert "1 compiled, 2 already up to date" in changed.stdout


def test_a_pyc_that_cannot_be_written_fails_the_run_naming_the_file(tmp_path: Path) -> None:
    files = _tree(tmp_path)
    (tmp_path / "__pycache__").write_text("a file where the cache folder should be")
    out = _run(tmp_path)
    assert out.returncode == 1
    assert f"cannot write the bytecode of {files['top']}" in out.stderr
    assert "2 compiled" in out.stdout  # the others are still compiled


def test_refuses_a_missing_path_and_a_bad_job_count(tmp_path: Path) -> None:
    missing = _run(tmp_path / "nowhere")
    assert missing.returncode == 2
    assert f"no such file or folder: {tmp_path / 'nowhere'}" in missing.stderr
    jobs = subprocess.run([sys.executable, str(TOOL), "--jobs", "0", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert jobs.returncode == 2 and "--jobs must be at least 1, got 0" in jobs.stderr
