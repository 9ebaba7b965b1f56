"""Answer extraction and equality for math benchmarks (MATH500, AIME, AMC, MinervaMATH, GSM8K).

``extract_answer`` pulls the final answer out of a model response; ``prepare_gold`` classifies
and parses a gold answer once; ``answer_matches`` decides whether an extracted answer equals it,
with `math-verify <https://github.com/huggingface/Math-Verify>`_ (``parse`` + ``verify``) behind
a normalisation layer. Grading a response under a time limit, one or many in worker processes,
is :mod:`saopd.eval.grading` (``grade``, ``grade_many``).

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

math-verify's own timeouts use ``signal.alarm`` and fail outside the main thread, so they are
always switched off here (``parsing_timeout=None``, ``timeout_seconds=None``): the caller bounds
the time (:mod:`saopd.eval.grading` puts one deadline around the whole grading of a response).
Answers that would make SymPy build astronomically large integers (numeric exponents of 10^7 or
more, numeric power towers that big, factorials of 10^6 or more) are unequal unparsed, since no
deadline can interrupt that C-level work.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from math import log2
from typing import Any, Literal

from math_verify import parse, verify

from saopd.latex import last_boxed, match_brace

__all__ = [
    "MAX_ANSWER_CHARS",
    "MAX_RESPONSE_CHARS",
    "GoldAnswerError",
    "PreparedGold",
    "answer_matches",
    "extract_answer",
    "normalize_answer",
    "prepare_gold",
]

MAX_RESPONSE_CHARS = 100_000
"""Only the last this many characters of a response are searched for its answer."""
MAX_ANSWER_CHARS = 1_000
"""Longer extracted answers are graded wrong without parsing (no benchmark gold is near this)."""
_MAX_SCI_EXPONENT = 1_000  # plain numbers like 1e5000 are left to the (guarded) LaTeX path


class GoldAnswerError(ValueError):
    """A gold answer that cannot be parsed at all: a dataset bug, not a model error."""


class _DropMathVerifyTimeoutWarning(logging.Filter):
    """Drops math-verify's "Timeout is disabled" warning: we enforce time limits ourselves."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropMathVerifyTimeoutWarning())


# --------------------------------------------------------------------------------------------
# Extraction
# --------------------------------------------------------------------------------------------

_ANSWER_IS_RE = re.compile(r"answer\s+is\s*:?", re.IGNORECASE)
_SENTENCE_END_RE = re.compile(r"\.(?:\s|$)")
_TRAILING_JUNK = " \t\r\n.,;:!*"


def _strip_answer(ans: str) -> str:
    """Trims whitespace, markdown bold and trailing punctuation around a prose answer."""
    return ans.strip().lstrip("*").rstrip(_TRAILING_JUNK).strip()


def _strip_math_delimiters(ans: str) -> str:
    """Removes one enclosing ``$...$``, ``\\(...\\)`` or ``\\[...\\]``, if any."""
    ans = ans.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if ans.startswith(left) and ans.endswith(right) and len(ans) >= len(left) + len(right):
            return ans[len(left) : len(ans) - len(right)].strip()
    return ans


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
        boxed = last_boxed(text)
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
class PreparedGold:
    """A gold answer classified and normalised once (:func:`prepare_gold`).

    ``kind``: how answers are compared with it: ``choice`` (option letter ``letter``),
    ``text`` (case-insensitive words), ``number`` (exact rational ``value``, else
    math-verify) or ``math`` (math-verify).
    """

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
def _prepare_gold_text(gold: str) -> PreparedGold:
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
        return PreparedGold(gold, norm, "choice", letter=letter)
    if (wrapped and _WRAPPED_WORDS_RE.fullmatch(norm)) or _WORDS_RE.fullmatch(norm):
        return PreparedGold(gold, _text_key(norm), "text")
    value = _as_number(norm)
    if value is not None:
        return PreparedGold(gold, norm, "number", value=value)
    if all(isinstance(x, str) for x in _mv_parse(_to_latex(norm))):  # [] or a bare-string fallback
        raise GoldAnswerError(f"math-verify cannot parse gold answer {gold!r}")
    return PreparedGold(gold, norm, "math")


def _math_verify_equal(gold_norm: str, pred_norm: str) -> bool:
    pred_latex = _to_latex(pred_norm)
    if _is_explosive(pred_latex):
        return False
    gold_parsed = _mv_parse(_to_latex(gold_norm))
    pred_parsed = _mv_parse(pred_latex)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(list(gold_parsed), list(pred_parsed), timeout_seconds=None))


def answer_matches(gold: PreparedGold, answer: str) -> bool:
    """Whether an extracted answer (:func:`extract_answer`) equals a prepared gold.

    No time limit of its own: math-verify may take long on odd answers, so callers that
    need a bound run it under a deadline (:func:`saopd.eval.grading.grade_detailed`).
    """
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


def prepare_gold(gold: object) -> PreparedGold:
    """A gold answer ready for :func:`answer_matches` (cached per gold string).

    ``gold``: a LaTeX string, a full solution ending in ``\\boxed{...}`` or GSM8K's ``#### 72``,
    an int, or an integer-valued float (AMC's ``27.0``). Raises :class:`GoldAnswerError` (a
    ``ValueError`` naming the gold) when it cannot be parsed at all.
    """
    return _prepare_gold_text(_gold_text(gold))

