"""tools/check_file_size.py (issue 29): it names every Python file over the ceiling with its
line count, longest first, and passes a tree that keeps under it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECKER = REPO / "tools" / "check_file_size.py"


def _check(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECKER), *map(str, args)], capture_output=True,
                          text=True, timeout=60)


def _write(path: Path, lines: int, *, last_newline: bool = True) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(f"x{i} = {i}" for i in range(lines))
    path.write_text(text + ("\n" if last_newline else ""))


def test_names_each_offender_with_its_count_longest_first(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    _write(pkg / "ok.py", 600)  # at the ceiling: fine
    _write(pkg / "sub" / "long.py", 601)
    _write(pkg / "longer.py", 750, last_newline=False)  # a last line without newline counts
    _write(pkg / "notes.txt", 5000)  # not Python: ignored
    out = _check(pkg)
    assert out.returncode == 1
    assert out.stdout.splitlines() == [
        f"{pkg / 'longer.py'}: 750 lines (limit 600)",
        f"{pkg / 'sub' / 'long.py'}: 601 lines (limit 600)",
    ]
    assert "2 file(s) over 600 lines" in out.stderr


def test_passes_under_the_ceiling_and_honours_max_lines(tmp_path: Path) -> None:
    _write(tmp_path / "a.py", 600)
    _write(tmp_path / "b.py", 12)
    ok = _check(tmp_path)
    assert ok.returncode == 0 and ok.stdout == ""
    tight = _check("--max-lines", "20", tmp_path / "a.py", tmp_path / "b.py")
    assert tight.returncode == 1
    assert tight.stdout.splitlines() == [f"{tmp_path / 'a.py'}: 600 lines (limit 20)"]


def test_a_missing_path_is_an_error_not_a_pass(tmp_path: Path) -> None:
    out = _check(tmp_path / "nowhere")
    assert out.returncode == 2 and "no such file or folder" in out.stderr


def test_the_package_keeps_under_the_ceiling() -> None:
    """saopd/ itself (what `make lint` checks), so `make test` and CI catch a file that grew."""
    out = _check(REPO / "saopd")
    assert out.returncode == 0, out.stdout + out.stderr
