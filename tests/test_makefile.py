"""The Makefile's recipes let Python write the bytecode of what it imports, even where the
environment says not to (``PYTHONDONTWRITEBYTECODE=1``, set on these machines): set-up installs
without compiling the venv's files, and every process of ``make test``/``make run`` would
otherwise compile each module it imports from source again."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from saopd.paths import repo_root


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_a_recipe_writes_the_bytecode_of_what_it_imports(tmp_path: Path) -> None:
    (tmp_path / "probe_module.py").write_text("VALUE = 1\n")
    script = "import os, sys; sys.path.insert(0, os.environ['PROBE_DIR']); import probe_module"
    # a target of the project's Makefile, added for this call only (make --eval)
    probe = f'saopd-probe: ; @echo "[$$PYTHONDONTWRITEBYTECODE]" && {sys.executable} -c "{script}"'
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PROBE_DIR": str(tmp_path)}
    # the same Python outside make writes nothing: the variable is in force
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
    assert not (tmp_path / "__pycache__").exists()
    out = subprocess.run(["make", "-s", "--eval", probe, "saopd-probe"], cwd=repo_root(),
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"  # not passed on to the recipe
    written = [p.name for p in (tmp_path / "__pycache__").iterdir()]
    assert len(written) == 1 and written[0].startswith("probe_module.")
    assert written[0].endswith(".pyc")
