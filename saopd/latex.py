"""Small LaTeX text helpers shared by data preparation and grading (plain Python, no imports of
sympy or torch, so the DVC stages stay light)."""

from __future__ import annotations


def match_brace(text: str, open_idx: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``open_idx``, or None if it is never closed.

    Braces are counted by depth; a backslash escapes the next character, so ``\\{``, ``\\}``
    and ``\\\\`` do not count.
    """
    depth = 0
    i, n = open_idx, len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None
