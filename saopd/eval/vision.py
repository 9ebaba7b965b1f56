"""Answer formats of vision-language benchmarks: counting, multiple choice, numbers with tolerance.

A problem's format is ``metadata["format"]`` of its row (the ``prepare_vlm`` stage writes it;
converted benchmarks should too):

- ``count`` (CountQA-style exact match): the extracted answer is an integer (digits, with
  thousands separators, or a number word "zero" to "twenty") equal to the gold integer;
- ``choice`` (multiple choice, letter extraction): the extracted option letter equals the gold
  letter, case-insensitively. Letters come from ``\\boxed{B}``, "the answer is (B)" / "answer: B",
  a parenthesised ``(B)``, a bare ``B`` / ``B.`` / ``B)`` as the response's last word, or, when the
  option texts are known (``metadata["choices"]``), from the one option text the response names;
- ``numeric`` (chart values, ChartQA-style relaxed accuracy): the extracted number ``x`` is
  correct when ``|x - gold| <= tolerance * |gold|`` (``metadata["tolerance"]``, default 0.05;
  an exact match when the gold is 0). Percent signs, units after the number and thousands
  separators are ignored. With ``metadata["precision"]`` (MathVista's decimals), ``x`` is first
  rounded to that many decimals;
- ``text`` (short text answers, e.g. a chart's category label): the answer span (below),
  normalised (lower case, ``\text{}`` and surrounding punctuation, articles and extra spaces
  removed), equals the normalised gold answer.

Extraction order for every format: the content of the last ``\\boxed{...}``, else the text after
the last "answer is" / "answer:", else the whole response; the *last* number (or letter) found
there counts, so intermediate reasoning does not. A response with nothing extractable is wrong.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from saopd.latex import match_brace

__all__ = [
    "VISION_FORMATS",
    "VisionGrade",
    "answer_span",
    "extract_choice",
    "extract_count",
    "extract_number",
    "grade_vision",
    "is_vision_format",
    "normalize_text",
]

VISION_FORMATS = ("count", "choice", "numeric", "text")
DEFAULT_TOLERANCE = 0.05

_NUMBER_WORDS = {w: i for i, w in enumerate((
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen", "twenty"))}
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_RE = re.compile(r"answer\s*(?:is|:)\s*:?", re.IGNORECASE)
_NUMBER_RE = re.compile(r"(?<![\w.])[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
                        r"|(?<![\w.])[-+−]?\.\d+")
_WORD_RE = re.compile(r"\b(" + "|".join(_NUMBER_WORDS) + r")\b", re.IGNORECASE)


class VisionGrade(NamedTuple):
    """``correct``; ``extracted``: the answer found (as text), None if none was."""

    correct: bool
    extracted: str | None


def is_vision_format(fmt: Any) -> bool:
    """Whether ``fmt`` (a row's ``metadata["format"]``) is graded by this module."""
    return fmt in VISION_FORMATS


def answer_span(response: str) -> str:
    """Where the final answer is looked for: the last ``\\boxed{...}``'s content, else the text
    after the last "answer is"/"answer:", else the whole response."""
    boxes = list(_BOX_RE.finditer(response))
    for m in reversed(boxes):
        close = match_brace(response, m.end() - 1)
        if close is not None:
            return response[m.end():close]
    answers = list(_ANSWER_RE.finditer(response))
    if answers:
        return response[answers[-1].end():]
    return response


def _to_number(text: str) -> float | None:
    text = text.replace(",", "").replace("−", "-")
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def extract_number(response: str) -> float | None:
    """The last number of the answer span (:func:`answer_span`), e.g. ``"about 1,250.5 units"``
    -> 1250.5; number words are not read here. None when there is none."""
    found = _NUMBER_RE.findall(answer_span(response))
    return _to_number(found[-1]) if found else None


def extract_count(response: str) -> int | None:
    """The last integer of the answer span: digits (``"7"``, ``"1,024"``) or a number word
    (``"seven"``), whichever comes last; a non-integral number (``"2.5"``) gives None."""
    span = answer_span(response)
    best: tuple[int, int] | None = None  # (position, value)
    for m in _NUMBER_RE.finditer(span):
        value = _to_number(m.group())
        if value is not None and value.is_integer():
            best = (m.start(), int(value))
        elif value is not None:
            best = (m.start(), -(10**18))  # a non-integer last number: no count
    for m in _WORD_RE.finditer(span):
        if best is None or m.start() > best[0]:
            best = (m.start(), _NUMBER_WORDS[m.group().lower()])
    if best is None or best[1] == -(10**18):
        return None
    return best[1]


def extract_choice(response: str, letters: str = "ABCDEFGH",
                   choices: Sequence[str] | None = None) -> str | None:
    """The option letter a response picks (upper case), None if it picks none.

    In the answer span (:func:`answer_span`): a span that is just a letter (``"B"``, ``"(B)"``,
    ``"B."``); else the last parenthesised letter ``(B)``; else a last word that is a single
    letter; else, with ``choices`` (option texts in letter order), the one option text named in
    the span (none or several named: None).
    """
    span = answer_span(response).strip()
    valid = set(letters.upper())
    bare = re.fullmatch(r"[\s(\[*]*([A-Za-z])[\s)\].:*]*", span)
    if bare and bare.group(1).upper() in valid:
        return bare.group(1).upper()
    paren = [m.group(1).upper() for m in re.finditer(r"\(([A-Za-z])\)", span)
             if m.group(1).upper() in valid]
    if paren:
        return paren[-1]
    words = re.findall(r"[A-Za-z]+", span)
    if words and len(words[-1]) == 1 and words[-1].upper() in valid and words[-1] != "a":
        return words[-1].upper()
    if choices:
        named = [letters[i] for i, text in enumerate(choices)
                 if i < len(letters) and re.search(rf"\b{re.escape(str(text))}\b", span,
                                                   re.IGNORECASE)]
        if len(named) == 1:
            return named[0].upper()
    return None


def grade_vision(response: str, gold: str, fmt: str,
                 metadata: Mapping[str, Any] | None = None) -> VisionGrade:
    """Grade one response of a vision benchmark row in format ``fmt`` (module docstring).

    ``metadata`` may hold ``choices`` (option texts, for ``choice``) and ``tolerance`` (relative,
    for ``numeric``). Raises ``ValueError`` for an unknown format or a gold answer that does not
    fit its format (a dataset bug, not a model error).
    """
    meta = dict(metadata or {})
    gold = str(gold).strip()
    if fmt == "count":
        want = _to_number(gold)
        if want is None or not want.is_integer():
            raise ValueError(f"count gold answer {gold!r} is not an integer")
        got = extract_count(response)
        return VisionGrade(got is not None and got == int(want),
                           None if got is None else str(got))
    if fmt == "choice":
        if not re.fullmatch(r"[A-Za-z]", gold):
            raise ValueError(f"choice gold answer {gold!r} is not a single option letter")
        letter = extract_choice(response, choices=meta.get("choices"))
        return VisionGrade(letter is not None and letter == gold.upper(), letter)
    if fmt == "numeric":
        want = _to_number(gold.rstrip("%").strip())
        if want is None:
            raise ValueError(f"numeric gold answer {gold!r} is not a number")
        tol = float(meta.get("tolerance", DEFAULT_TOLERANCE))
        if not 0.0 <= tol < 1.0:
            raise ValueError(f"numeric tolerance must be in [0, 1), got {tol!r}")
        got = extract_number(response)
        if got is None:
            return VisionGrade(False, None)
        if meta.get("precision") is not None:
            got = round(got, int(meta["precision"]))
        ok = got == want if want == 0 else abs(got - want) <= tol * abs(want) + 1e-12
        return VisionGrade(ok, f"{got:g}")
    if fmt == "text":
        want_text = normalize_text(gold)
        if not want_text:
            raise ValueError(f"text gold answer {gold!r} is empty after normalisation")
        got_text = normalize_text(answer_span(response))
        return VisionGrade(bool(got_text) and got_text == want_text, got_text or None)
    raise ValueError(f"unknown answer format {fmt!r}; vision formats: {list(VISION_FORMATS)}")


def normalize_text(text: str) -> str:
    """A short answer for exact comparison: ``\\text{x}`` -> ``x``, lower case, leading
    articles (a/an/the) and surrounding punctuation/markup removed, inner whitespace collapsed."""
    text = re.sub(r"\\(?:text|mathrm|textbf)\s*\{([^{}]*)\}", r"\1", text)
    text = " ".join(text.lower().split())
    text = text.strip(" \t\n.,;:!?*\"'`$()[]{}")
    text = re.sub(r"^(?:a|an|the)\s+", "", text)
    return " ".join(text.split())
