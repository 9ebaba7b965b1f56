"""Small LaTeX text helpers shared by data preparation and grading (plain Python, no imports of
sympy or torch, so the DVC stages stay light)."""

from __future__ import annotations

import re

__all__ = ["last_boxed", "match_brace"]


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


_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _boxed_content(text: str, start: int) -> str | None:
    """Content of the ``\\boxed``/``\\fbox`` command whose name ends at ``start``."""
    i = start
    while i < len(text) and text[i] in " \t":
        i += 1
    if i < len(text) and text[i] == "{":
        close = match_brace(text, i)
        return None if close is None else text[i + 1 : close]
    if i > start:  # "\boxed 5$" (no braces): up to the closing "$" or the end of the line
        return re.split(r"[$\n]", text[i:], maxsplit=1)[0]
    return None


def _strip_boxed(ans: str) -> str:
    """Trims whitespace and a trailing full stop inside a box (``5!`` keeps its factorial)."""
    return ans.strip().rstrip(" \t\r\n.").strip()


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed``/``\\fbox`` in ``text`` that has one, stripped of
    whitespace and a trailing full stop; ``\\boxed{\\boxed{5}}`` gives ``5``; ``None`` if none.

    Braces are matched with :func:`match_brace` (nested groups kept whole, ``\\{`` does not
    count); a box never closed is passed over; ``\\boxed 5$`` (no braces) runs to the ``$`` or
    the end of the line. The one boxed-answer extractor: gold answers of the DVC stages and the
    answers of model responses both go through it.
    """
    for m in reversed(list(_BOX_RE.finditer(text))):
        content = _boxed_content(text, m.end())
        if content is None:
            continue
        content = _strip_boxed(content)
        while True:  # \boxed{\boxed{5}}
            inner = _BOX_RE.match(content)
            if inner is None:
                break
            nested = _boxed_content(content, inner.end())
            if nested is None:
                break
            content = _strip_boxed(nested)
        if content:
            return content
    return None
