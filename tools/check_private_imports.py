"""Fail if a module imports a private name (``_name``) from another module of the package.

    python tools/check_private_imports.py [package_dir ...]    # default: saopd

A leading underscore means "used by this module only": importing it elsewhere couples two modules
through a detail neither declared. ``import-linter`` (``lint-imports``) checks the layers; this
checks the names. Both run in ``make lint`` and in the test suite (tests/test_architecture.py).
Exits 1 and lists every ``file:line: module imports _name from other.module`` found.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    """``saopd/filters/base.py`` -> ``saopd.filters.base`` (``__init__`` -> the package)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def private_imports(package_dir: Path) -> list[str]:
    """Every cross-module import of a private name under ``package_dir``, as messages."""
    package_dir = package_dir.resolve()
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        name = module_name(path, package_dir)
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:  # relative import: resolve against this module's package
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith(package_dir.name) or target == name:
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path}:{node.lineno}: {name} imports {alias.name} "
                                 f"from {target}")
    return found


def main(argv: list[str]) -> int:
    dirs = [Path(a) for a in argv] or [Path(__file__).resolve().parent.parent / "saopd"]
    found = [msg for d in dirs for msg in private_imports(d)]
    for msg in found:
        print(msg)
    if found:
        print(f"{len(found)} private name(s) imported across modules", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
