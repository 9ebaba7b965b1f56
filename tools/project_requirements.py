"""The requirements of this project and of the extras asked for, one per line, from pyproject.toml.

    python tools/project_requirements.py [EXTRA ...] > requirements.txt

`make vllm-base` installs them into .venv-vllm before saopd itself: everything saopd's editable
install would pull in, with nothing written in this tree, so that it can run beside `make setup`
(whose editable install writes saopd.egg-info here); the editable install afterwards finds them
all in place. An extra pyproject.toml does not define is an error naming it and those it does.
Needs ``tomllib`` (Python 3.11+) or ``tomli``; without either it prints nothing and says so on
stderr, and the editable install installs the requirements itself, as it would anyway.
"""

from __future__ import annotations

import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def requirements(project: dict, extras: list[str]) -> list[str]:
    """``project``'s (pyproject's ``[project]`` table) dependencies, then each extra's, in order,
    each once. ``KeyError`` naming an extra it does not define."""
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise KeyError(f"no extra {', '.join(unknown)} in pyproject.toml (it has: "
                       f"{', '.join(sorted(optional)) or 'none'})")
    found: list[str] = []
    for req in [*project.get("dependencies", []), *(r for e in extras for r in optional[e])]:
        if req not in found:
            found.append(req)
    return found


def main(argv: list[str]) -> int:
    try:
        import tomllib
    except ImportError:
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            print("project_requirements: no tomllib or tomli; nothing listed", file=sys.stderr)
            return 0
    with PYPROJECT.open("rb") as f:
        project = tomllib.load(f)["project"]
    try:
        print("\n".join(requirements(project, argv)))
    except KeyError as err:
        print(f"project_requirements: {err.args[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
