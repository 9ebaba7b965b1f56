"""Answer extraction and grading for math benchmarks (MATH500, AIME, AMC, MinervaMATH, GSM8K).

``extract_answer`` pulls the final answer out of a model response; ``grade`` decides whether it
matches a gold answer, with `math-verify <https://github.com/huggingface/Math-Verify>`_ (``parse``
+ ``verify``) behind a normalisation layer; ``grade_many`` grades many pairs in worker processes.

Normalisation decisions (applied to both the gold and the extracted answer):

* Units are not graded: a trailing ``\\text{ cm}`` / ``\\mbox{ inches}^2`` / ``\\mathrm{...}``,
  degrees (``^\\circ``, ``°``), ``\\%`` and ``\\$`` are dropped on either side, so ``50\\%`` equals
  ``50`` and ``30^\\circ`` equals ``30``. Nothing is converted: ``0.5`` is *not* ``50\\%`` and
  ``\\frac{\\pi}{6}`` is *not* ``30^\\circ``. (math-verify itself also drops bare unit words such
  as ``5 meters``.)
* LaTeX spacing (``\\,`` ``\\!`` ``\\;`` ``\\:`` ``\\ `` ``\\quad`` ``~``), ``\\dfrac``/``\\tfrac``,
  ``\\displaystyle``, ``$`` delimiters and a trailing full stop are ignored; ``10,\\!080``,
  ``10{,}080`` and ``10,080`` are the integer 10080 (thousands separators are only recognised when
  the whole answer is one number with groups of exactly three digits, so ``1,-2`` stays a list).
* Plain numbers (``025``, ``27.0``, ``.35625``, ``4.5e33``) are compared exactly as rationals;
  distinct integers are never equal. Non-integers closer than 1e-6 go to math-verify, which rounds
  floats to 6 decimals (so ``0.333333`` equals ``\\frac13`` but ``0.33`` does not).
* Multiple-choice golds (``\\text{(C)}``) match ``C``, ``(C)``, ``\\textbf{(C)}`` or ``(C) <text>``,
  case-insensitively. Word golds (the whole gold in ``\\text{}``, or one alphabetic word of at least
  four letters) are compared as case-insensitive text, so ``\\text{Evelyn}`` matches ``evelyn`` but
  not an anagram (math-verify alone would compare them as products of symbols).
* Anything else goes to math-verify (strict mode): sets/lists are unordered (``1,-2`` = ``-2,1``),
  tuples and intervals are ordered and keep their brackets, ``x=5`` matches ``5``, mixed numbers
  ``1\\frac45`` are 9/5, and a base subscript is dropped by math-verify (``52_8`` matches ``52``).
* Minerva-style golds: ``np.arcsin(...)`` is read as ``\\arcsin(...)``; ``-1./3`` as ``-1/3``.

Time limits: math-verify's own timeouts use ``signal.alarm`` and fail outside the main thread, so
they are always switched off here (``parsing_timeout=None``, ``timeout_seconds=None``) and one
deadline of ``timeout_s`` covers the whole grading of a response instead:

* in the main thread, a ``SIGALRM`` interval timer (any timer the caller had is re-armed after);
* in other threads, a per-thread profile hook (``sys.setprofile``) that raises once the deadline
  has passed, at the next Python or C function call. It slows grading in that thread about 2x and
  is skipped when a profiler is already installed in the thread (then there is no time limit).

If the timeout lands where Python discards exceptions (a ``__del__`` run by the garbage
collector), it is raised again every 0.25 s until it sticks. Neither mechanism can interrupt one
long C-level operation (SymPy computing ``10^{10^{10}}`` holds the GIL for minutes), so answers
that would make SymPy build astronomically large integers (numeric exponents of 10^7 or more,
numeric power towers that big, factorials of 10^6 or more) are graded wrong unparsed, and
``grade_many`` kills a worker process that has made no progress for ``2 * timeout_s + 1``
seconds, counts the response it was grading as timed out, and carries on with a fresh worker
(likewise if a worker dies). A response that times out is graded wrong and counted
(``GradeResult.timed_out``).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import re
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from math import log2
from multiprocessing.connection import Connection, wait
from typing import Any, Literal, NamedTuple

from math_verify import parse, verify

from saopd.latex import match_brace

__all__ = [
    "GoldAnswerError",
    "GradeResult",
    "extract_answer",
    "grade",
    "grade_detailed",
    "grade_many",
    "grade_many_detailed",
    "normalize_answer",
]

logger = logging.getLogger(__name__)

MAX_RESPONSE_CHARS = 100_000
"""Only the last this many characters of a response are searched for its answer."""
MAX_ANSWER_CHARS = 1_000
"""Longer extracted answers are graded wrong without parsing (no benchmark gold is near this)."""
_MAX_SCI_EXPONENT = 1_000  # plain numbers like 1e5000 are left to the (guarded) LaTeX path


class GoldAnswerError(ValueError):
    """A gold answer that cannot be parsed at all: a dataset bug, not a model error."""


class GradeResult(NamedTuple):
    """The outcome of grading one response.

    Attributes:
        correct: whether the extracted answer matches the gold.
        answer: the extracted answer (``None`` if the response has none).
        timed_out: grading ran out of time (then ``correct`` is False).
    """

    correct: bool
    answer: str | None
    timed_out: bool = False


class _Timeout(BaseException):
    """Raised inside grading when its deadline passes (BaseException: nothing swallows it)."""


class _DropMathVerifyTimeoutWarning(logging.Filter):
    """Drops math-verify's "Timeout is disabled" warning: we enforce time limits ourselves."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropMathVerifyTimeoutWarning())


# --------------------------------------------------------------------------------------------
# Extraction
# --------------------------------------------------------------------------------------------

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ANSWER_IS_RE = re.compile(r"answer\s+is\s*:?", re.IGNORECASE)
_SENTENCE_END_RE = re.compile(r"\.(?:\s|$)")
_TRAILING_JUNK = " \t\r\n.,;:!*"


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


def _strip_answer(ans: str) -> str:
    """Trims whitespace, markdown bold and trailing punctuation around a prose answer."""
    return ans.strip().lstrip("*").rstrip(_TRAILING_JUNK).strip()


def _strip_boxed(ans: str) -> str:
    """Trims whitespace and a trailing full stop inside a box (``5!`` keeps its factorial)."""
    return ans.strip().rstrip(" \t\r\n.").strip()


def _strip_math_delimiters(ans: str) -> str:
    """Removes one enclosing ``$...$``, ``\\(...\\)`` or ``\\[...\\]``, if any."""
    ans = ans.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if ans.startswith(left) and ans.endswith(right) and len(ans) >= len(left) + len(right):
            return ans[len(left) : len(ans) - len(right)].strip()
    return ans


def _last_boxed(text: str) -> str | None:
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


def _after_answer_is(tail: str) -> str:
    """The answer that follows "answer is": a math span, or the rest of the sentence/line."""
    tail = tail.lstrip(" \t*")
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if tail.startswith(left):
            end = tail.find(right, len(left))
            if end != -1:
                return tail[len(left) : end]
    line = tail.split("\n", 1)[0]
    return _SENTENCE_END_RE.split(line, maxsplit=1)[0]


def extract_answer(response: str | None) -> str | None:
    """The final answer of a model response, or ``None``.

    In order of preference: the content of the last complete ``\\boxed{...}`` / ``\\fbox{...}``
    (balanced braces, nested boxes unwrapped; the brace-less ``\\boxed 5`` form too; an unclosed
    box, as in a truncated response, is skipped), else the text after the last GSM8K ``####``,
    else the text after the last "answer is" ("The final answer is $5$. I hope it is correct.").
    Only the last ``MAX_RESPONSE_CHARS`` characters are searched. Never raises.
    """
    if not isinstance(response, str) or not response:
        return None
    text = response[-MAX_RESPONSE_CHARS:]
    if "\\boxed" in text or "\\fbox" in text:
        boxed = _last_boxed(text)
        if boxed:
            return boxed
    pos = text.rfind("####")
    if pos != -1:
        ans = _strip_answer(_strip_math_delimiters(text[pos + 4 :].split("\n", 1)[0]))
        if ans:
            return ans
    starts = [m.end() for m in _ANSWER_IS_RE.finditer(text)]
    if starts:
        ans = _strip_answer(_after_answer_is(text[starts[-1] :]))
        ans = _strip_answer(_strip_math_delimiters(ans))
        if ans:
            return ans
    return None


# --------------------------------------------------------------------------------------------
# Normalisation
# --------------------------------------------------------------------------------------------

_TEXT_CMDS = r"(?:text|textrm|textnormal|textit|textbf|textsf|mbox|mathrm|mathbf|mathit|rm)"
_TEXT_START_RE = re.compile(r"\\" + _TEXT_CMDS + r"\s*(?=\{)")
_INNER_TEXT_RE = re.compile(r"\\" + _TEXT_CMDS + r"\s*\{([^{}]*)\}")
_TRAILING_UNIT_RE = re.compile(
    r"\\" + _TEXT_CMDS + r"\s*\{[^{}]*\}(?:\s*\^\s*(?:\{\s*\d\s*\}|\d))?\s*$"
)
_DEGREE_RE = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|°|\\degree(?![A-Za-z])")
_SPACING_RE = re.compile(r"\\\\|\\[,:;!> ]|\\q?quad(?![A-Za-z])|~")
_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_THIN_SPACE_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?: \d{3})+(?:\.\d+)?")
_NUMBER_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_SCI_RE = re.compile(r"([-+]?(?:\d+(?:\.\d*)?|\.\d+))[eE]([-+]?\d+)")
_NUMPY_RE = re.compile(r"\b(?:np|numpy|math)\.(?=(?:arc)?(?:sin|cos|tan)|exp|log|sqrt|pi)")
_DANGLING_POINT_RE = re.compile(r"(\d)\.(?![\d\\])")
_CHOICE_RE = re.compile(r"\(\s*([A-Ea-e])\s*\)")
_BARE_CHOICE_RE = re.compile(r"([A-Ea-e])\s*\)?")
_GOLD_CHOICE_RE = re.compile(r"\(\s*([A-Ea-e])\s*\)|([A-E])")
_WORDS_RE = re.compile(r"[A-Za-z]{4,}|[A-Za-z]{2,}(?: [A-Za-z]{2,})+")
_WRAPPED_WORDS_RE = re.compile(r"[A-Za-z][A-Za-z' .-]*[A-Za-z]")


def _unwrap_text(s: str) -> tuple[str, bool]:
    """Strips ``\\text{...}``-like wrappers spanning the whole string; (content, was_wrapped)."""
    wrapped = False
    while True:
        m = _TEXT_START_RE.match(s)
        if m is None or match_brace(s, m.end()) != len(s) - 1:
            return s, wrapped
        s = s[m.end() + 1 : -1].strip()
        wrapped = True


def _drop_trailing_units(s: str) -> str:
    """Drops trailing ``\\text{ unit}``-like groups that follow some other content."""
    while True:
        m = _TRAILING_UNIT_RE.search(s)
        if m is None:
            return s
        head = s[: m.start()].rstrip()
        if not head or head[-1] in "_^{":
            return s
        s = head


def normalize_answer(answer: str) -> str:
    """Canonical LaTeX for an answer string (see the module docstring for what is dropped)."""
    return _normalize(answer)[0]


def _normalize(answer: str) -> tuple[str, bool]:
    """``normalize_answer`` and whether the whole answer was wrapped in ``\\text{}``-like."""
    s = answer.strip().replace("\\$", "").replace("$", "")
    s = _strip_math_delimiters(s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\displaystyle", "")
    s = _DEGREE_RE.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    s = re.sub(r",\\!\s*", ",", s).replace("{,}", ",")
    s = _SPACING_RE.sub(lambda m: m.group() if m.group() == "\\\\" else " ", s)
    s = re.sub(r"\s+", " ", s).strip()
    s = _drop_trailing_units(s)
    s, wrapped = _unwrap_text(s)
    s = _NUMPY_RE.sub(r"\\", s)
    s = _DANGLING_POINT_RE.sub(r"\1", s)
    s = s.strip().rstrip(".;").strip()
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    elif _THIN_SPACE_THOUSANDS_RE.fullmatch(s):
        s = s.replace(" ", "")
    return s, wrapped


def _as_number(s: str) -> Fraction | None:
    """The exact value of a plain decimal/scientific number string, else None."""
    if not _NUMBER_RE.fullmatch(s):
        return None
    exp = re.search(r"[eE]([-+]?\d+)$", s)
    if exp is not None and abs(int(exp.group(1))) > _MAX_SCI_EXPONENT:
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


_E_SUBSCRIPT_RE = re.compile(r"(?<![A-Za-z\\])E_")
_ODOT_SUBSCRIPT_RE = re.compile(r"_\{?\s*\\odot\s*\}?")


def _to_latex(s: str) -> str:
    """The LaTeX handed to math-verify for a normalised answer.

    Rewrites a whole-string scientific number (``4.5e33``) as ``4.5\\times 10^{33}`` (else ``e``
    is Euler's number), and works around two gaps in latex2sympy's grammar seen in MinervaMATH
    golds: ``E_{1}`` (written ``\\mathcal{E}_{1}``) and the solar subscript ``L_{\\odot}``.
    """
    m = _SCI_RE.fullmatch(s)
    if m is not None:
        return f"{m.group(1)}\\times 10^{{{int(m.group(2))}}}"
    s = _E_SUBSCRIPT_RE.sub(r"\\mathcal{E}_", s)
    return _ODOT_SUBSCRIPT_RE.sub("_{sun}", s)


def _choice_letter(s: str) -> str | None:
    """The option letter of "(C)", "C", "C)" or "(C) <text>", upper-cased."""
    m = _CHOICE_RE.match(s)
    if m is not None:
        return m.group(1).upper()
    m = _BARE_CHOICE_RE.fullmatch(s)
    return None if m is None else m.group(1).upper()


def _text_key(s: str) -> str:
    return " ".join(s.replace("\\ ", " ").split()).casefold().rstrip(".")


_EXPONENT_RE = re.compile(r"\^\s*(?:\{|(\d+))")
_LATEX_CMD_RE = re.compile(r"\\[A-Za-z]+")
_HUGE = 10**7  # exponents this large are where SymPy's integer arithmetic stops being instant
_HUGE_FACTORIAL = 10**6
_CLOSERS = {")": "(", "}": "{"}


def _numeric_size(expr: str) -> int | None:
    """A numeral or numeric power tower (``2^{3^{4}}``), capped at ``_HUGE``; None otherwise."""
    e = re.sub(r"[\s{}()]", "", expr)
    if e.isdigit():
        return int(e) if len(e) < 9 else _HUGE
    m = re.fullmatch(r"(\d+)\^(.+)", e)
    if m is None:
        return None
    base = int(m.group(1)) if len(m.group(1)) < 9 else _HUGE
    exponent = _numeric_size(m.group(2))
    if exponent is None or base <= 1:
        return None if exponent is None else base
    if exponent * log2(base) > 24:  # 2^24 > _HUGE
        return _HUGE
    return min(base**exponent, _HUGE)


def _operand_before(s: str, end: int) -> str:
    """The factorial operand ending just before ``s[end]``: digits or a bracketed group."""
    i = end - 1
    while i >= 0 and s[i] == " ":
        i -= 1
    if i >= 0 and s[i] in _CLOSERS:
        opener, depth = _CLOSERS[s[i]], 0
        for j in range(i, -1, -1):
            depth += s[j] == s[i]
            depth -= s[j] == opener
            if depth == 0:
                return s[j : i + 1]
        return ""
    j = i
    while j >= 0 and s[j].isdigit():
        j -= 1
    return s[j + 1 : i + 1]


def _is_explosive(s: str) -> bool:
    """Whether SymPy might compute an astronomically large integer (uninterruptible C code)."""
    for m in re.finditer(r"!", s):
        size = _numeric_size(_operand_before(s, m.start()))
        if size is not None and size >= _HUGE_FACTORIAL:
            return True
    for m in _EXPONENT_RE.finditer(s):
        if m.group(1) is not None:
            exponent = m.group(1)
        else:
            close = match_brace(s, m.end() - 1)
            exponent = s[m.end() : close if close is not None else len(s)]
        size = _numeric_size(exponent)
        if size is not None and size >= _HUGE:
            return True
        bare = _LATEX_CMD_RE.sub("", exponent)
        if size is None and not re.search(r"[A-Za-z]", bare) and ("^" in bare or "!" in bare):
            return True  # e.g. 2^{10^{10}+1}: numeric, nested, too odd to size up
    return False


# --------------------------------------------------------------------------------------------
# Gold answers and comparison
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Gold:
    """A prepared gold answer."""

    raw: str
    norm: str
    kind: Literal["choice", "text", "number", "math"]
    value: Fraction | None = None
    letter: str | None = None


@lru_cache(maxsize=16_384)
def _mv_parse(latex: str) -> tuple[Any, ...]:
    """math-verify ``parse`` of a normalised answer (cached; its own timeout switched off)."""
    return tuple(parse(f"${latex}$", parsing_timeout=None))  # type: ignore[arg-type]


def _gold_text(gold: object) -> str:
    """The gold answer as a string (ints, integer floats like AMC's ``27.0``, strings)."""
    if gold is None or isinstance(gold, bool):
        raise GoldAnswerError(f"gold answer {gold!r} is not an answer")
    if isinstance(gold, float):
        if gold != gold or gold in (float("inf"), float("-inf")):
            raise GoldAnswerError(f"gold answer {gold!r} is not a finite number")
        return str(int(gold)) if gold.is_integer() else repr(gold)
    return gold if isinstance(gold, str) else str(gold)


@lru_cache(maxsize=16_384)
def _prepare_gold(gold: str) -> _Gold:
    """Classifies and (for math golds) parses a gold answer; raises GoldAnswerError if hopeless."""
    text = gold
    if "\\boxed" in text or "\\fbox" in text or "####" in text:
        text = extract_answer(text) or ""
    norm, wrapped = _normalize(text)
    if not norm:
        raise GoldAnswerError(f"gold answer {gold!r} is empty after normalisation")
    choice = _GOLD_CHOICE_RE.fullmatch(norm)
    if choice is None and wrapped:
        choice = _BARE_CHOICE_RE.fullmatch(norm)
    if choice is not None:
        letter = next(g for g in choice.groups() if g).upper()
        return _Gold(gold, norm, "choice", letter=letter)
    if (wrapped and _WRAPPED_WORDS_RE.fullmatch(norm)) or _WORDS_RE.fullmatch(norm):
        return _Gold(gold, _text_key(norm), "text")
    value = _as_number(norm)
    if value is not None:
        return _Gold(gold, norm, "number", value=value)
    if all(isinstance(x, str) for x in _mv_parse(_to_latex(norm))):  # [] or a bare-string fallback
        raise GoldAnswerError(f"math-verify cannot parse gold answer {gold!r}")
    return _Gold(gold, norm, "math")


def _math_verify_equal(gold_norm: str, pred_norm: str) -> bool:
    pred_latex = _to_latex(pred_norm)
    if _is_explosive(pred_latex):
        return False
    gold_parsed = _mv_parse(_to_latex(gold_norm))
    pred_parsed = _mv_parse(pred_latex)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(list(gold_parsed), list(pred_parsed), timeout_seconds=None))


def _equal(gold: _Gold, answer: str) -> bool:
    """Whether an extracted answer matches a prepared gold (no time limit of its own)."""
    pred = normalize_answer(answer)
    if not pred:
        return False
    if gold.kind == "choice":
        return _choice_letter(_INNER_TEXT_RE.sub(r"\1", pred).strip()) == gold.letter
    if gold.kind == "text":
        return _text_key(_INNER_TEXT_RE.sub(r"\1", pred)) == gold.norm
    if pred == gold.norm:
        return True
    if gold.kind == "number" and gold.value is not None:
        value = _as_number(pred)
        if value is not None:
            if value == gold.value:
                return True
            if abs(value - gold.value) >= Fraction(1, 10**6):  # math-verify rounds to 6 places
                return False
    return _math_verify_equal(gold.norm, pred)


# --------------------------------------------------------------------------------------------
# Deadlines
# --------------------------------------------------------------------------------------------


_RETRY_S = 0.25
"""A timeout raised where Python discards it (in a finaliser) is raised again this much later."""
_NEVER = float("inf")


def _raise_timeout(*_: object) -> None:
    raise _Timeout()


@contextlib.contextmanager
def _alarm_deadline(seconds: float) -> Iterator[None]:
    """Main thread: SIGALRM interval timer; an outer timer and handler are restored after."""
    start = time.monotonic()
    old_handler = signal.signal(signal.SIGALRM, _raise_timeout)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds, _RETRY_S)
    try:
        yield
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:  # even if the timer fired just now
            signal.signal(signal.SIGALRM, old_handler)
            if old_delay > 0:  # re-arm the caller's timer with what is left of it
                left = max(old_delay - (time.monotonic() - start), 1e-3)
                signal.setitimer(signal.ITIMER_REAL, left, old_interval)


@contextlib.contextmanager
def _profile_deadline(seconds: float) -> Iterator[None]:
    """Any thread: a profile hook that raises at the first function call after the deadline."""
    if sys.getprofile() is not None:  # a profiler owns the hook: no limit rather than break it
        yield
        return
    clock = time.monotonic
    next_raise = [clock() + seconds]  # a list: disarming it must not be a call (see finally)

    def hook(frame: object, event: str, arg: object) -> None:
        if clock() > next_raise[0]:
            next_raise[0] = clock() + _RETRY_S
            raise _Timeout()

    sys.setprofile(hook)
    try:
        yield
    finally:
        next_raise[0] = _NEVER
        sys.setprofile(None)


def _deadline(seconds: float | None) -> contextlib.AbstractContextManager[None]:
    if seconds is None or seconds <= 0:
        return contextlib.nullcontext()
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        return _alarm_deadline(seconds)
    return _profile_deadline(seconds)


# --------------------------------------------------------------------------------------------
# Public grading API
# --------------------------------------------------------------------------------------------


def grade_detailed(response: str | None, gold: object, *, timeout_s: float | None = 5.0
                   ) -> GradeResult:
    """Grades one response and says what was extracted and whether time ran out.

    Args:
        response: the model's full response (anything that is not a string grades wrong).
        gold: the gold answer: a LaTeX string, a full solution ending in ``\\boxed{...}`` or
            GSM8K's ``#### 72``, an int, or an integer-valued float (AMC's ``27.0``).
        timeout_s: wall-clock limit for the whole grading (gold parsing included); ``None`` or
            ``<= 0`` for none. Works in any thread (see the module docstring).

    Raises:
        GoldAnswerError (a ValueError): the gold cannot be parsed at all (a dataset bug).
    """
    gold_str = _gold_text(gold)
    answer: str | None = None
    try:
        with _deadline(timeout_s):
            prepared = _prepare_gold(gold_str)
            answer = extract_answer(response)
            if answer is None or len(answer) > MAX_ANSWER_CHARS:
                return GradeResult(False, answer)
            return GradeResult(_equal(prepared, answer), answer)
    except _Timeout:
        return GradeResult(False, answer, timed_out=True)
    except GoldAnswerError:
        raise
    except Exception:  # a bug in a parser must not stop an evaluation: the answer is wrong
        logger.debug("grading failed for answer %r", answer, exc_info=True)
        return GradeResult(False, answer)


def grade(response: str | None, gold: object, *, timeout_s: float | None = 5.0) -> bool:
    """Whether ``response``'s final answer equals ``gold`` (see :func:`grade_detailed`).

    Returns a plain bool; never raises on odd responses (empty, non-string, huge). A response that
    runs out of time is graded wrong. Raises ``GoldAnswerError`` (a ``ValueError`` naming the gold)
    when the gold cannot be parsed at all.
    """
    return grade_detailed(response, gold, timeout_s=timeout_s).correct


# --------------------------------------------------------------------------------------------
# Process pool
# --------------------------------------------------------------------------------------------


def _worker_main(conn: Connection, timeout_s: float | None) -> None:
    """Worker process: grades chunks in its main thread (alarm deadlines), a reply per response."""
    with contextlib.suppress(ValueError):  # not the main thread (e.g. embedded): nothing to do
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    conn.send(("ready",))
    while True:
        try:
            chunk = conn.recv()
        except EOFError:
            return
        if chunk is None:
            return
        for idx, response, gold in chunk:
            try:
                res = grade_detailed(response, gold, timeout_s=timeout_s)
                conn.send(("ok", idx, tuple(res)))
            except GoldAnswerError as exc:
                conn.send(("gold", idx, str(exc)))


def _default_context() -> mp.context.BaseContext:
    methods = mp.get_all_start_methods()
    if "forkserver" in methods:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        return ctx
    return mp.get_context("spawn")


class _Worker:
    """One worker process, its pipe, and the indices it still owes."""

    def __init__(self, ctx: mp.context.BaseContext, timeout_s: float | None) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, timeout_s), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.dead = False
        self.pending: deque[int] = deque()
        self.started = time.monotonic()
        self.last_progress = self.started

    def stop(self, *, kill: bool = False) -> None:
        if not kill:
            with contextlib.suppress(OSError, ValueError):
                self.conn.send(None)
            self.proc.join(timeout=2.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=2.0)
        self.conn.close()


def grade_many_detailed(
    pairs: Iterable[tuple[str | None, object]],
    *,
    workers: int | None = None,
    timeout_s: float | None = 5.0,
    chunk_size: int | None = None,
    mp_context: str | None = None,
    startup_timeout_s: float = 120.0,
) -> list[GradeResult]:
    """Grades ``(response, gold)`` pairs in worker processes; results in input order.

    Args:
        pairs: ``(response, gold)`` pairs, as for :func:`grade_detailed`.
        workers: number of processes (default: CPU count, at most one per chunk); ``0`` grades in
            this process instead (alarm/profile deadlines only, no kill of stuck C code).
        timeout_s: per-response limit, enforced by SIGALRM in each worker's main thread; a worker
            silent for ``2 * timeout_s + 1`` s is killed and that response counts as timed out.
        chunk_size: responses sent to a worker at once (default: up to 64, about 4 chunks/worker).
        mp_context: multiprocessing start method (default ``forkserver`` where available, with
            this module preloaded, else ``spawn``); ``fork`` is fastest but unsafe with threads.
        startup_timeout_s: give up (RuntimeError) if a worker has not started in this time.

    Raises:
        GoldAnswerError: some gold cannot be parsed (the first one found is named).
    """
    items = [(r[-MAX_RESPONSE_CHARS:] if isinstance(r, str) else None, g) for r, g in pairs]
    n = len(items)
    if n == 0:
        return []
    if workers != 0 and mp.current_process().daemon:
        logger.warning("grade_many in a daemonic process cannot start workers: grading in-process")
        workers = 0
    if workers == 0:
        return [grade_detailed(r, g, timeout_s=timeout_s) for r, g in items]
    try:
        return _grade_in_workers(items, workers, timeout_s, chunk_size, mp_context,
                                 startup_timeout_s)
    except _WorkerStartError as err:
        # e.g. inside a joblib/loky worker (a parallel sweep job), where children cannot be
        # started with spawn/forkserver: grade here instead (no hard kill of stuck C code)
        logger.warning("%s; grading %d responses in this process instead", err, n)
        return [grade_detailed(r, g, timeout_s=timeout_s) for r, g in items]


class _WorkerStartError(RuntimeError):
    """No grading worker process could be started."""


def _grade_in_workers(items: list[tuple[str | None, object]], workers: int | None,
                      timeout_s: float | None, chunk_size: int | None, mp_context: str | None,
                      startup_timeout_s: float) -> list[GradeResult]:
    n = len(items)
    n_workers = max(1, workers if workers is not None else (os.cpu_count() or 1))
    if chunk_size is None:
        chunk_size = max(1, min(64, -(-n // (4 * n_workers))))
    chunks: deque[list[int]] = deque(
        list(range(i, min(i + chunk_size, n))) for i in range(0, n, chunk_size)
    )
    n_workers = min(n_workers, len(chunks))
    ctx = mp.get_context(mp_context) if mp_context else _default_context()
    hard_limit = None if timeout_s is None or timeout_s <= 0 else 2 * timeout_s + 1.0
    results: list[GradeResult | None] = [None] * n
    pool: list[_Worker] = []

    def handle(worker: _Worker, msg: tuple[Any, ...]) -> None:
        worker.last_progress = time.monotonic()
        if msg[0] == "ready":
            worker.ready = True
        elif msg[0] == "ok":
            results[msg[1]] = GradeResult(*msg[2])
            worker.pending.remove(msg[1])
        else:  # "gold"
            raise GoldAnswerError(msg[2])

    def replace(i: int, why: str) -> None:
        """Worker ``i`` died or hung: the response it was on fails, the rest are re-queued."""
        worker = pool[i]
        while True:  # keep what it finished before dying
            try:
                if not worker.conn.poll():
                    break
                handle(worker, worker.conn.recv())
            except (EOFError, OSError):
                break
        if not worker.ready:
            worker.stop(kill=True)
            raise _WorkerStartError(f"a grading worker {why} before it started")
        if worker.pending:
            idx = worker.pending.popleft()
            logger.warning("grading worker %s on response %d: counted as timed out", why, idx)
            results[idx] = GradeResult(False, None, timed_out=True)
            if worker.pending:
                chunks.appendleft(list(worker.pending))
        worker.stop(kill=True)
        pool[i] = _Worker(ctx, timeout_s)

    try:
        pool = [_Worker(ctx, timeout_s) for _ in range(n_workers)]
        while chunks or any(w.pending for w in pool):
            for i, worker in enumerate(pool):
                if worker.dead or not worker.proc.is_alive():
                    replace(i, "died")
                    continue
                if worker.ready and not worker.pending and chunks:
                    chunk = chunks.popleft()
                    try:
                        worker.conn.send([(idx, *items[idx]) for idx in chunk])
                    except (OSError, ValueError):
                        chunks.appendleft(chunk)
                        worker.dead = True
                        continue
                    worker.pending.extend(chunk)
                    worker.last_progress = time.monotonic()
            for conn in wait([w.conn for w in pool if not w.dead], timeout=0.5):
                worker = next(w for w in pool if w.conn is conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    worker.dead = True
                    continue
                handle(worker, msg)
            now = time.monotonic()
            for i, worker in enumerate(pool):
                if not worker.ready and now - worker.started > startup_timeout_s:
                    raise _WorkerStartError(
                        f"a grading worker did not start in {startup_timeout_s} s")
                if hard_limit and worker.pending and now - worker.last_progress > hard_limit:
                    replace(i, f"was stuck for {hard_limit:.0f} s")
    finally:
        for worker in pool:
            worker.stop(kill=worker.dead or bool(worker.pending))
    final = [r if r is not None else GradeResult(False, None, True) for r in results]
    n_timeouts = sum(r.timed_out for r in final)
    if n_timeouts:
        logger.warning("%d of %d responses timed out while grading (graded wrong)", n_timeouts, n)
    return final


def grade_many(
    pairs: Iterable[tuple[str | None, object]],
    *,
    workers: int | None = None,
    timeout_s: float | None = 5.0,
    chunk_size: int | None = None,
    mp_context: str | None = None,
) -> list[bool]:
    """Grades ``(response, gold)`` pairs in a process pool; a list of bools in input order.

    Each worker grades in its main thread with an alarm-based per-response deadline; timed-out
    responses are graded wrong, counted and logged (use :func:`grade_many_detailed` to get the
    flags). See :func:`grade_many_detailed` for the arguments.
    """
    return [r.correct for r in grade_many_detailed(
        pairs, workers=workers, timeout_s=timeout_s, chunk_size=chunk_size,
        mp_context=mp_context)]
