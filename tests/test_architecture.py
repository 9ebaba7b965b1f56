"""The package's layers and boundaries (docs/architecture.md): the import contract in
pyproject.toml holds, no private name crosses modules, the config schema stays torch-free, and
both checks really fail on a violation."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
CHECKER = REPO / "tools" / "check_private_imports.py"


def _lint_imports(cwd: Path, *args: str, pythonpath: Path | None = None
                  ) -> subprocess.CompletedProcess[str]:
    exe = str(LINT_IMPORTS) if LINT_IMPORTS.exists() else shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports not installed (it is in the dev extras: make setup)")
    env = None
    if pythonpath is not None:
        import os

        env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run([exe, "--no-cache", *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=600)


def test_the_import_contract_holds() -> None:
    out = _lint_imports(REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_no_private_name_is_imported_across_modules() -> None:
    out = subprocess.run([sys.executable, str(CHECKER)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_checks_fail_on_a_cycle_and_on_a_private_import(tmp_path: Path) -> None:
    # a two-layer package whose lower layer imports the upper one, and a private import
    _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "",
        "pkg/low/base.py": "from pkg.high.glue import run\n_helper = 1\n",
        "pkg/high/__init__.py": "",
        "pkg/high/glue.py": "from pkg.low.base import _helper\n\ndef run():\n    return _helper\n",
        "contract.toml": """
            [tool.importlinter]
            root_package = "pkg"

            [[tool.importlinter.contracts]]
            name = "layers"
            type = "layers"
            layers = ["pkg.high", "pkg.low"]
            """,
    })
    out = _lint_imports(tmp_path, "--config", "contract.toml", pythonpath=tmp_path)
    assert out.returncode != 0
    assert "pkg.low is not allowed to import pkg.high" in out.stdout
    found = subprocess.run([sys.executable, str(CHECKER), str(tmp_path / "pkg")],
                           capture_output=True, text=True)
    assert found.returncode == 1
    assert "pkg.high.glue imports _helper from pkg.low.base" in found.stdout


def test_the_config_schema_imports_no_torch() -> None:
    code = ("import sys, saopd.config, saopd.choices, saopd.validation, saopd.io; "
            "bad = sorted(m for m in ('torch', 'lightning', 'transformers') if m in sys.modules); "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
