"""Fail if a Python file of the package is longer than the ceiling (600 lines by default).

    python tools/check_file_size.py [--max-lines N] [dir_or_file ...]    # default: saopd

A file past a few hundred lines usually holds two concerns; issue 29 keeps every module of
``saopd/`` at or under 600 lines, split along the seams it already has. Lines are counted as
``wc -l`` counts them (newline characters; a last line without one counts too). Exits 1 and
prints every offender as ``path: N lines (limit M)``, longest first, then their count on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

MAX_LINES = 600


def line_count(path: Path) -> int:
    """Lines of ``path``: its newlines, plus one for a last line that does not end with one."""
    data = path.read_bytes()
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def oversized(paths: list[Path], max_lines: int = MAX_LINES) -> list[tuple[Path, int]]:
    """``(file, lines)`` of every ``*.py`` file under ``paths`` (files or folders) longer than
    ``max_lines``, longest first (ties by path)."""
    files: set[Path] = set()
    for path in paths:
        if path.is_dir():
            files.update(path.rglob("*.py"))
        elif path.is_file():
            files.add(path)
        else:
            raise FileNotFoundError(f"no such file or folder: {path}")
    counts = [(f, line_count(f)) for f in files]
    return sorted(((f, n) for f, n in counts if n > max_lines), key=lambda fn: (-fn[1], str(fn[0])))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path,
                        default=[Path(__file__).resolve().parent.parent / "saopd"],
                        help="files or folders to check (default: the saopd package)")
    parser.add_argument("--max-lines", type=int, default=MAX_LINES,
                        help=f"the ceiling (default {MAX_LINES})")
    args = parser.parse_args(argv)
    if args.max_lines < 1:
        parser.error(f"--max-lines must be >= 1, got {args.max_lines}")
    try:
        found = oversized(args.paths, args.max_lines)
    except FileNotFoundError as err:
        print(err, file=sys.stderr)
        return 2
    for path, lines in found:
        print(f"{path}: {lines} lines (limit {args.max_lines})")
    if found:
        print(f"{len(found)} file(s) over {args.max_lines} lines", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
