"""MM-IFEval grading: rule-checked compose-level constraints, judge-checked everything else.

MM-IFEval (Ding et al. 2025, "MM-IFEngine: Towards Multimodal Instruction Following"; official
code: github.com/SYuan03/MM-IFEngine, ``eval_mmifeval/score_multi_constraint_mp_with_image_v11.py``
and ``data_gen/utils/function_and_compare.py``; the same logic is in VLMEvalKit and lmms-eval)
has two kinds of rows, marked by ``tag``:

- ``C-Level`` (compose level): an instruction plus constraints, each
  ``{"key": ..., "value": <the constraint's text>, "judge": {"method": ..., ...}}``. The row's
  score is the mean over its constraints of a 0/1 verdict. ``method`` is

  - ``rule_based``: ``judge.verify_funcs`` is a list of ``{"func": <name>, "params": [...]}``;
    the constraint holds when every function returns True for the response. The functions are
    :data:`RULE_FUNCTIONS` (the official names, including the official spelling ``metioned``);
  - ``direct_gpt``: an LLM judge (GPT-4o, with the image) scores the constraint;
  - ``cmp_gpt``: an LLM judge compares the response with the model's response to the prompt
    *without* that constraint (the official ``aux_cmp_gpt`` rows);

- ``P-Level`` (perception level): a question whose ground truth is a list of strings; an LLM
  judge says whether the response covers every element.

The benchmark's accuracy is the mean of the rows' scores. Here, constraints are graded by rules
when their method is ``rule_based``; ``direct_gpt``, ``cmp_gpt`` and every ``P-Level`` row are
graded only when a judge is given (:data:`MMIFEvalJudge`, a callable returning a score in
[0, 1]); otherwise they are reported as *ungraded*: they do not count towards the row's mean,
and a row with nothing graded has no score at all (it is left out of the accuracy and counted).
So without a judge the score is the rule-graded part of the benchmark, not the official number.

Deviation from the official code: sentence splitting uses :func:`split_sentences`, a regular
expression splitter (sentence-final ``.``/``!``/``?``, optionally followed by closing quotes or
brackets, then whitespace or the end; common abbreviations and initials do not end a sentence)
in place of NLTK's punkt model, which is not installed here and needs a download. They agree
on ordinary prose; they can differ on unusual abbreviations. Everything else follows the
official functions.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = [
    "JUDGE_METHODS",
    "RULE_FUNCTIONS",
    "JudgeRequest",
    "MMIFEvalGrade",
    "MMIFEvalJudge",
    "check_constraints",
    "grade_mmifeval",
    "split_paragraphs",
    "split_sentences",
]

#: Constraint methods that only an LLM judge can grade.
JUDGE_METHODS = ("direct_gpt", "cmp_gpt")
METHODS = ("rule_based", *JUDGE_METHODS)
TAGS = ("C-Level", "P-Level")


# --------------------------------------------------------------------------------- splitting


def _clean(text: str) -> str:
    """Each line stripped, then the whole text stripped (the official ``clean_text``)."""
    return "\n".join(line.strip() for line in text.splitlines()).strip()


def split_paragraphs(text: str) -> list[str]:
    """Paragraphs: the cleaned text split at blank lines (``\\n\\s*\\n``), empty ones dropped."""
    return [p for p in re.split(r"\n\s*\n", _clean(text)) if p.strip()]


_ABBREVIATIONS = frozenset({
    "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "e.g", "i.e", "fig", "figs",
    "no", "nos", "inc", "ltd", "co", "corp", "u.s", "u.k", "a.m", "p.m", "approx", "ca", "cf",
    "al", "vol", "pp", "mt", "ft", "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept",
    "oct", "nov", "dec",
})
_SENTENCE_END = re.compile(r"[.!?]+[\"'”’)\]]*(?=\s|$)")


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text`` (stripped, non-empty), a stand-in for NLTK's ``sent_tokenize``.

    A sentence ends at ``.``, ``!`` or ``?`` (repeated, optionally followed by closing quotes or
    brackets) that is followed by whitespace or the end of the text, except after a common
    abbreviation (``Dr.``, ``e.g.``, ...) or a single-letter initial (``J.``). Line breaks alone
    do not end a sentence (as in punkt).
    """
    text = text.strip()
    out: list[str] = []
    start = 0
    for m in _SENTENCE_END.finditer(text):
        if m.group().startswith("."):
            words = text[start:m.start()].split()
            last = words[-1].lower().lstrip("(\"'") if words else ""
            if last in _ABBREVIATIONS or re.fullmatch(r"[a-z]", last):
                continue
        piece = text[start:m.end()].strip()
        if piece:
            out.append(piece)
        start = m.end()
    tail = text[start:].strip()
    if tail:
        out.append(tail)
    return out


# ------------------------------------------------------------------------- rule constraints


def check_whether_response_paragraph_number_in_range(
    response: str, lower_bound: int, upper_bound: int
) -> bool:
    """Number of paragraphs (blank-line separated) in ``[lower_bound, upper_bound]``."""
    return lower_bound <= len(split_paragraphs(response)) <= upper_bound


def check_whether_response_sentence_number_in_range(
    response: str, lower_bound: int, upper_bound: int
) -> bool:
    """Number of sentences of the whole response in ``[lower_bound, upper_bound]``."""
    return lower_bound <= len(split_sentences(_clean(response))) <= upper_bound


def check_whether_each_paragraph_sentence_number_in_range(
    response: str, lower_bound: int, upper_bound: int
) -> bool:
    """Every paragraph has a number of sentences in ``[lower_bound, upper_bound]``."""
    return all(lower_bound <= len(split_sentences(p)) <= upper_bound
               for p in split_paragraphs(response))


def check_whether_each_paragraph_sentence_number_in_range_list(
    response: str, ranges: Sequence[Sequence[int]]
) -> bool:
    """Exactly ``len(ranges)`` paragraphs, paragraph i having a sentence count in
    ``ranges[i] = [lower, upper]``."""
    paragraphs = split_paragraphs(response)
    if len(paragraphs) != len(ranges):
        return False
    return all(lo <= len(split_sentences(p)) <= hi
               for p, (lo, hi) in zip(paragraphs, ranges, strict=True))


def _word_count(text: str) -> int:
    """Words after removing every character that is not a word character, space, ``.`` or ``-``."""
    return len(re.sub(r"[^\w\s.-]", "", text).split())


def check_whether_response_word_count_in_range(
    response: str, lower_bound: int, upper_bound: int
) -> bool:
    """Number of words of the whole response in ``[lower_bound, upper_bound]``."""
    return lower_bound <= _word_count(response) <= upper_bound


def check_whether_each_paragraph_word_count_in_range(
    response: str, lower_bound: int, upper_bound: int
) -> bool:
    """Every paragraph has a word count in ``[lower_bound, upper_bound]``."""
    return all(lower_bound <= _word_count(p) <= upper_bound for p in split_paragraphs(response))


def check_whether_whole_response_not_contain_certain_substrings(
    response: str, substrings: Sequence[str]
) -> bool:
    """None of ``substrings`` occurs in the response (case-sensitive)."""
    return all(s not in response for s in substrings)


def check_whether_whole_response_not_contain_certain_substring(
    response: str, substring: str
) -> bool:
    """``substring`` does not occur in the response (case-sensitive)."""
    return substring not in response


def check_whether_each_sentence_begin_with_certain_substring(
    response: str, substring: str
) -> bool:
    """Every sentence starts with ``substring``."""
    return all(s.startswith(substring) for s in split_sentences(_clean(response)))


def check_whether_each_paragraph_begin_with_certain_substring(
    response: str, substring: str
) -> bool:
    """Every paragraph starts with ``substring``."""
    return all(p.startswith(substring) for p in split_paragraphs(response))


def check_whether_each_paragraph_end_with_certain_substring(
    response: str, substring: str
) -> bool:
    """Every paragraph ends with ``substring``."""
    return all(p.endswith(substring) for p in split_paragraphs(response))


def check_whether_each_sentence_end_with_certain_substring(
    response: str, substring: str
) -> bool:
    """Every sentence ends with ``substring``."""
    return all(s.endswith(substring) for s in split_sentences(_clean(response)))


def check_whether_whole_response_begin_with_certain_substring(
    response: str, substring: str
) -> bool:
    """The stripped response starts with ``substring``."""
    return response.strip().startswith(substring)


def check_whether_whole_response_end_with_certain_substring(
    response: str, substring: str
) -> bool:
    """The stripped response ends with ``substring``."""
    return response.strip().endswith(substring)


def _keyword_count(text: str, keyword: str) -> int:
    """Whole-word, case-insensitive occurrences of ``keyword`` (``\\b`` on both sides)."""
    return len(re.findall(r"\b" + re.escape(keyword.lower()) + r"\b", _clean(text).lower()))


def check_whether_each_keyword_in_list_metioned_in_range(
    response: str, keywords: Sequence[str], lower_bound_times: int, upper_bound_times: int
) -> bool:
    """Each keyword occurs (whole word, any case) between ``lower_bound_times`` and
    ``upper_bound_times`` times. (``metioned``: the official function name.)"""
    return all(lower_bound_times <= _keyword_count(response, k) <= upper_bound_times
               for k in keywords)


def check_whether_total_keyword_in_list_metioned_in_range(
    response: str, keywords: Sequence[str], lower_bound_times: int, upper_bound_times: int
) -> bool:
    """The keywords together occur (whole word, any case) between ``lower_bound_times`` and
    ``upper_bound_times`` times."""
    total = sum(_keyword_count(response, k) for k in keywords)
    return lower_bound_times <= total <= upper_bound_times


def check_percentage_number_precision_in_response(response: str, precision: int) -> bool:
    """Every number before a ``%`` has a decimal point and exactly ``precision`` decimals
    (``12.50%`` for 2; ``12%`` fails)."""
    for num in re.findall(r"(\d+\.\d+|\d+)\s*%", response):
        if "." not in num or len(num.split(".")[1]) != precision:
            return False
    return True


_ANY_NUMBER = re.compile(
    r"(?<!\w)[+-]?(?:\d{1,3}(?:,\d{3})*(?:\.\d+)?|\d+\.\d+|\.\d+|\d+)(?:[eE][+-]?\d+)?%?(?!\w)"
)


def check_number_precision_in_response(response: str, precision: int) -> bool:
    """Every number (thousands separators, decimals, scientific notation and percentages
    included) has exactly ``precision`` decimals in its mantissa; an integer passes only when
    ``precision`` is 0."""
    for m in _ANY_NUMBER.finditer(response):
        mantissa = re.split("[eE]", m.group().replace(",", "").rstrip("%"))[0]
        decimals = len(mantissa.split(".")[-1]) if "." in mantissa else 0
        if decimals != precision:
            return False
    return True


_ARABIC_NUMBER = re.compile(
    r"(?<![.\w])(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?%?|\d+\.\d+%?|\d+%?|\d+(?:\.\d+)?(?:[eE][+-]?\d+))"
    r"(?![.\w])",
    re.IGNORECASE,
)


def check_whether_has_no_arabic_number_in_response(response: str) -> bool:
    """The response contains no number written with digits (``3``, ``1,000``, ``0.5%``,
    ``5e-10``); digits inside words (``COVID19``) do not count."""
    return _ARABIC_NUMBER.search(response) is None


#: The official rule functions by name, as ``verify_funcs`` call them:
#: ``func(response, *params) -> bool``.
RULE_FUNCTIONS: dict[str, Callable[..., bool]] = {f.__name__: f for f in (
    check_whether_response_paragraph_number_in_range,
    check_whether_response_sentence_number_in_range,
    check_whether_each_paragraph_sentence_number_in_range,
    check_whether_each_paragraph_sentence_number_in_range_list,
    check_whether_response_word_count_in_range,
    check_whether_each_paragraph_word_count_in_range,
    check_whether_whole_response_not_contain_certain_substrings,
    check_whether_whole_response_not_contain_certain_substring,
    check_whether_each_sentence_begin_with_certain_substring,
    check_whether_each_paragraph_begin_with_certain_substring,
    check_whether_each_paragraph_end_with_certain_substring,
    check_whether_each_sentence_end_with_certain_substring,
    check_whether_whole_response_begin_with_certain_substring,
    check_whether_whole_response_end_with_certain_substring,
    check_whether_each_keyword_in_list_metioned_in_range,
    check_whether_total_keyword_in_list_metioned_in_range,
    check_percentage_number_precision_in_response,
    check_number_precision_in_response,
    check_whether_has_no_arabic_number_in_response,
)}


# ------------------------------------------------------------------------------------ grading


@dataclass(frozen=True)
class JudgeRequest:
    """What a judge is asked to score.

    ``kind``: ``direct_gpt`` (does ``response`` satisfy ``constraint``, looking at ``images``),
    ``cmp_gpt`` (the same; the official judge also sees the model's response to the prompt
    without this constraint, which ``saopd-eval`` does not sample: a judge needing it must
    produce it) or ``p_level`` (does ``response`` cover every element of ``answer`` for
    ``question``).
    """

    kind: str
    response: str
    constraint: str | None = None
    question: str | None = None
    answer: tuple[str, ...] | None = None
    images: tuple[str, ...] = ()


#: A judge: ``judge(request) -> score in [0, 1]`` (the official judges give 0 or 1).
MMIFEvalJudge = Callable[[JudgeRequest], float]


class MMIFEvalGrade(NamedTuple):
    """``score``: mean of the graded constraints' scores (C-Level) or the judge's score
    (P-Level), None when nothing was graded; ``graded`` / ``ungraded``: constraints (a P-Level
    row counts as one); ``constraints``: score per constraint key, None when ungraded."""

    score: float | None
    graded: int
    ungraded: int
    constraints: dict[str, float | None]


def _constraints(metadata: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The row's constraints, checked: method known, rule functions known and params a list."""
    cons = metadata.get("constraints")
    if not isinstance(cons, list):
        raise ValueError("mmifeval: metadata.constraints must be a list, got "
                         f"{type(cons).__name__}")
    for i, c in enumerate(cons):
        at = f"mmifeval: constraint {i}"
        if not isinstance(c, Mapping) or not isinstance(c.get("judge"), Mapping):
            raise ValueError(f"{at}: expected {{key, value, judge: {{method, ...}}}}, got {c!r}")
        method = c["judge"].get("method")
        if method not in METHODS:
            raise ValueError(f"{at} ({c.get('key')!r}): unknown judge method {method!r}; "
                             f"known: {list(METHODS)}")
        if method == "rule_based":
            funcs = c["judge"].get("verify_funcs")
            if not isinstance(funcs, list) or not funcs:
                raise ValueError(f"{at} ({c.get('key')!r}): rule_based needs a non-empty "
                                 "verify_funcs list")
            for f in funcs:
                if not isinstance(f, Mapping) or f.get("func") not in RULE_FUNCTIONS:
                    name = f.get("func") if isinstance(f, Mapping) else f
                    raise ValueError(f"{at} ({c.get('key')!r}): unknown rule function {name!r}")
                if not isinstance(f.get("params", []), list):
                    raise ValueError(f"{at} ({c.get('key')!r}): params of {f['func']} must be "
                                     "a list")
    return [dict(c) for c in cons]


def check_constraints(metadata: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` when a row's MM-IFEval metadata cannot be graded: a tag other than
    C-Level/P-Level, malformed constraints, an unknown method or rule function, or a P-Level
    row without its answer list. Used by the data stage, so bad rows are caught there."""
    tag = metadata.get("tag")
    if tag not in TAGS:
        raise ValueError(f"mmifeval: tag must be one of {list(TAGS)}, got {tag!r}")
    if tag == "C-Level":
        _constraints(metadata)
    elif not isinstance(metadata.get("answer_list"), list):
        raise ValueError("mmifeval: a P-Level row needs metadata.answer_list (a list)")


def _rule_score(constraint: Mapping[str, Any], response: str) -> float:
    for f in constraint["judge"]["verify_funcs"]:
        if not RULE_FUNCTIONS[f["func"]](response, *f.get("params", [])):
            return 0.0
    return 1.0


def _judged(judge: MMIFEvalJudge, request: JudgeRequest) -> float:
    score = float(judge(request))
    if not 0.0 <= score <= 1.0:
        raise ValueError(f"mmifeval judge returned {score!r} for a {request.kind} request; "
                         "scores must be in [0, 1]")
    return score


def grade_mmifeval(response: str, metadata: Mapping[str, Any], *,
                   judge: MMIFEvalJudge | None = None,
                   images: Sequence[str] = ()) -> MMIFEvalGrade:
    """Grade one response to an MM-IFEval row (module docstring).

    ``metadata``: the prepared row's metadata (``tag``, ``constraints`` for C-Level,
    ``question`` and ``answer_list`` for P-Level); ``images``: the row's image paths (passed to
    the judge). Raises ``ValueError`` for metadata that does not fit the format.
    """
    check_constraints(metadata)
    if metadata["tag"] == "P-Level":
        if judge is None:
            return MMIFEvalGrade(None, 0, 1, {"p_level": None})
        score = _judged(judge, JudgeRequest(
            "p_level", response, question=metadata.get("question"),
            answer=tuple(str(a) for a in metadata["answer_list"]), images=tuple(images)))
        return MMIFEvalGrade(score, 1, 0, {"p_level": score})
    scores: dict[str, float | None] = {}
    for i, c in enumerate(_constraints(metadata)):
        key = str(c.get("key", f"constraint_{i + 1}"))
        if key in scores:
            key = f"{key}#{i}"
        method = c["judge"]["method"]
        if method == "rule_based":
            scores[key] = _rule_score(c, response)
        elif judge is not None:
            scores[key] = _judged(judge, JudgeRequest(method, response,
                                                      constraint=str(c.get("value", "")),
                                                      images=tuple(images)))
        else:
            scores[key] = None
    graded = [s for s in scores.values() if s is not None]
    total = sum(graded) / len(graded) if graded else None
    return MMIFEvalGrade(total, len(graded), len(scores) - len(graded), scores)
