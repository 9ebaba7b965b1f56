"""Print saopd's requirements for a pip spec such as ``.[dev,ray]``, one per line, from
pyproject.toml: ``[project] dependencies`` and those of each extra named.

The Makefile installs them before saopd's own editable install, so that two venvs can download
and unpack their packages at the same time while the editable install (which writes
``saopd.egg-info`` in this tree) takes turns under a lock.

    python tools/pyproject_requirements.py '.[dev,ray]' > requirements.txt
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def requirements(spec: str, pyproject: Path = PYPROJECT) -> list[str]:
    """The requirements of ``spec`` (``.``, ``.[extra,...]``): the project's dependencies, then
    each named extra's, in order, without repeats. An extra that pyproject.toml does not define
    is an error naming it."""
    import tomllib  # Python 3.11+

    match = re.fullmatch(r"\.(?:\[([A-Za-z0-9_,\- ]*)\])?", spec.strip())
    if match is None:
        raise ValueError(f"{spec!r}: expected '.' or '.[extra,...]'")
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project.get("optional-dependencies", {})
    out = list(project.get("dependencies", []))
    for name in filter(None, (x.strip() for x in (match.group(1) or "").split(","))):
        if name not in extras:
            raise ValueError(f"{spec!r}: {pyproject} defines no extra {name!r} "
                             f"(it has {', '.join(sorted(extras))})")
        out += extras[name]
    return list(dict.fromkeys(out))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: pyproject_requirements.py '.[extra,...]'", file=sys.stderr)
        return 2
    try:
        print("\n".join(requirements(argv[0])))
    except ImportError:  # Python 3.10: no tomllib; the editable install installs them instead
        print("pyproject_requirements.py: Python 3.11+ reads pyproject.toml (tomllib); "
              "saopd's editable install will install its requirements", file=sys.stderr)
    except (ValueError, KeyError) as err:
        print(f"pyproject_requirements.py: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
