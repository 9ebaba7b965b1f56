"""MM-IFEval grading: every rule constraint true and false, judge-only constraints ungraded
without a judge and graded with one, and the runner's accounting of ungraded samples."""

from __future__ import annotations

import pytest

from saopd.eval import mmifeval as mif
from saopd.eval.mmifeval import (
    RULE_FUNCTIONS,
    JudgeRequest,
    check_constraints,
    grade_mmifeval,
    split_paragraphs,
    split_sentences,
)
from saopd.eval.runner import EvalProblem, grade_samples

TWO_PARAS = "The cat sat. It was happy!\n\nDr. Smith came at 3 p.m. today. He left."

# (function name, response, params, expected)
CASES = [
    ("check_whether_response_paragraph_number_in_range", TWO_PARAS, [2, 2], True),
    ("check_whether_response_paragraph_number_in_range", TWO_PARAS, [3, 5], False),
    ("check_whether_response_sentence_number_in_range", TWO_PARAS, [4, 4], True),
    ("check_whether_response_sentence_number_in_range", TWO_PARAS, [1, 3], False),
    ("check_whether_each_paragraph_sentence_number_in_range", TWO_PARAS, [2, 2], True),
    ("check_whether_each_paragraph_sentence_number_in_range", TWO_PARAS, [3, 3], False),
    ("check_whether_each_paragraph_sentence_number_in_range_list", TWO_PARAS,
     [[[1, 2], [2, 2]]], True),
    ("check_whether_each_paragraph_sentence_number_in_range_list", TWO_PARAS,
     [[[1, 2]]], False),  # one range for two paragraphs
    ("check_whether_response_word_count_in_range", "one two, three-four five.", [4, 4], True),
    ("check_whether_response_word_count_in_range", "one two, three-four five.", [5, 9], False),
    ("check_whether_each_paragraph_word_count_in_range", "a b c\n\nd e", [2, 3], True),
    ("check_whether_each_paragraph_word_count_in_range", "a b c\n\nd", [2, 3], False),
    ("check_whether_whole_response_not_contain_certain_substrings", "red and blue",
     [["green", "pink"]], True),
    ("check_whether_whole_response_not_contain_certain_substrings", "red and blue",
     [["green", "blue"]], False),
    ("check_whether_whole_response_not_contain_certain_substring", "red", ["Red"], True),
    ("check_whether_whole_response_not_contain_certain_substring", "red", ["re"], False),
    ("check_whether_each_sentence_begin_with_certain_substring", "- Apples. - Pears!", ["- "],
     True),
    ("check_whether_each_sentence_begin_with_certain_substring", "- Apples. Pears!", ["- "],
     False),
    ("check_whether_each_paragraph_begin_with_certain_substring", "# a\n\n# b", ["#"], True),
    ("check_whether_each_paragraph_begin_with_certain_substring", "# a\n\nb", ["#"], False),
    ("check_whether_each_paragraph_end_with_certain_substring", "a END\n\nb END", ["END"],
     True),
    ("check_whether_each_paragraph_end_with_certain_substring", "a END\n\nb", ["END"], False),
    ("check_whether_each_sentence_end_with_certain_substring", "Go now! Run fast!", ["!"],
     True),
    ("check_whether_each_sentence_end_with_certain_substring", "Go now. Run fast!", ["!"],
     False),
    ("check_whether_whole_response_begin_with_certain_substring", "  Dear Sir, hi", ["Dear"],
     True),
    ("check_whether_whole_response_begin_with_certain_substring", "Hi Dear", ["Dear"], False),
    ("check_whether_whole_response_end_with_certain_substring", "so long. THE END \n",
     ["THE END"], True),
    ("check_whether_whole_response_end_with_certain_substring", "THE END, bye", ["THE END"],
     False),
    ("check_whether_each_keyword_in_list_metioned_in_range",
     "Reddit users; a Redditor. reddit!", [["reddit"], 2, 2], True),  # Redditor not counted
    ("check_whether_each_keyword_in_list_metioned_in_range", "cat dog dog",
     [["cat", "dog"], 2, 3], False),
    ("check_whether_total_keyword_in_list_metioned_in_range", "cat dog dog",
     [["cat", "dog"], 3, 3], True),
    ("check_whether_total_keyword_in_list_metioned_in_range", "cat dog dog",
     [["cat", "dog"], 4, 9], False),
    ("check_percentage_number_precision_in_response", "up 12.50% and 3.25 %", [2], True),
    ("check_percentage_number_precision_in_response", "up 12% and 3.25%", [2], False),
    ("check_number_precision_in_response", "1,234.50 and 0.25 and 1.00e3", [2], True),
    ("check_number_precision_in_response", "1,234.50 and 7", [2], False),
    ("check_number_precision_in_response", "3 cats and 1,000 dogs", [0], True),
    ("check_whether_has_no_arabic_number_in_response", "three cats, COVID19 era", [], True),
    ("check_whether_has_no_arabic_number_in_response", "it costs 1,000 dollars", [], False),
    ("check_whether_has_no_arabic_number_in_response", "about 0.5% of it", [], False),
]


@pytest.mark.parametrize(("name", "response", "params", "expected"), CASES)
def test_rule_constraints(name: str, response: str, params: list, expected: bool) -> None:
    assert RULE_FUNCTIONS[name](response, *params) is expected


def test_every_rule_function_has_a_true_and_a_false_case_and_a_docstring() -> None:
    for name, func in RULE_FUNCTIONS.items():
        outcomes = {exp for n, _, _, exp in CASES if n == name}
        assert outcomes == {True, False}, name
        assert func.__doc__ and func.__doc__.strip(), name
    assert len(RULE_FUNCTIONS) == 19


def test_splitters() -> None:
    assert split_sentences(TWO_PARAS) == ["The cat sat.", "It was happy!",
                                          "Dr. Smith came at 3 p.m. today.", "He left."]
    assert split_sentences('He said "Stop." Then e.g. J. Doe left') == [
        'He said "Stop."', "Then e.g. J. Doe left"]
    assert split_sentences("  ") == []
    assert split_paragraphs("  a\n   \n\n b \n") == ["a", "b"]


def _c_level() -> dict:
    return {"format": "mmifeval", "tag": "C-Level", "constraints": [
        {"key": "length", "value": "Use 2 paragraphs.", "judge": {
            "method": "rule_based", "verify_funcs": [
                {"func": "check_whether_response_paragraph_number_in_range", "params": [2, 2]}]}},
        {"key": "end", "value": "End with 'Bye.'", "judge": {
            "method": "rule_based", "verify_funcs": [
                {"func": "check_whether_whole_response_end_with_certain_substring",
                 "params": ["Bye."]},
                {"func": "check_whether_response_word_count_in_range", "params": [1, 50]}]}},
        {"key": "tone", "value": "Use a formal tone.", "judge": {"method": "direct_gpt"}},
        {"key": "style", "value": "Like a poet.", "judge": {"method": "cmp_gpt"}},
    ]}


def test_c_level_rules_graded_judge_constraints_ungraded_without_judge() -> None:
    meta = _c_level()
    g = grade_mmifeval("Hello there.\n\nBye.", meta)
    assert g.score == 1.0 and (g.graded, g.ungraded) == (2, 2)
    assert g.constraints == {"length": 1.0, "end": 1.0, "tone": None, "style": None}
    g = grade_mmifeval("Hello there. Bye.", meta)  # one paragraph: the length rule fails
    assert g.score == 0.5 and g.constraints["length"] == 0.0
    g = grade_mmifeval("Hello.\n\nBye now", meta)  # the end rule fails (first of two funcs)
    assert g.constraints["end"] == 0.0


def test_judge_hook_grades_judge_only_constraints_and_p_level() -> None:
    seen: list[JudgeRequest] = []

    def judge(req: JudgeRequest) -> float:
        seen.append(req)
        return 1.0 if req.kind == "direct_gpt" else 0.0

    g = grade_mmifeval("Hello there.\n\nBye.", _c_level(), judge=judge, images=["/x.png"])
    assert g.score == pytest.approx(0.75) and (g.graded, g.ungraded) == (4, 0)
    assert [r.kind for r in seen] == ["direct_gpt", "cmp_gpt"]
    assert seen[0].constraint == "Use a formal tone." and seen[0].images == ("/x.png",)
    p = {"format": "mmifeval", "tag": "P-Level", "question": "What?", "answer_list": ["a", "b"]}
    assert grade_mmifeval("a b", p).score is None
    assert grade_mmifeval("a b", p, judge=lambda r: 1.0).score == 1.0
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        grade_mmifeval("a b", p, judge=lambda r: 2.0)


@pytest.mark.parametrize(("meta", "match"), [
    ({"tag": "X"}, "tag must be one of"),
    ({"tag": "C-Level", "constraints": "nope"}, "must be a list"),
    ({"tag": "C-Level", "constraints": [{"key": "k", "judge": {"method": "vibes"}}]},
     "unknown judge method 'vibes'"),
    ({"tag": "C-Level", "constraints": [{"key": "k", "judge": {
        "method": "rule_based", "verify_funcs": [{"func": "check_nothing", "params": []}]}}]},
     "unknown rule function 'check_nothing'"),
    ({"tag": "P-Level"}, "answer_list"),
])
def test_bad_metadata_is_refused(meta: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_constraints(meta)


def test_runner_grades_mmifeval_by_constraints_and_counts_ungraded(monkeypatch) -> None:
    import saopd.eval.graders as graders

    def no_math(*args, **kwargs):
        raise AssertionError("MM-IFEval rows must not go to math-verify")

    monkeypatch.setattr(graders, "grade_many", no_math)
    p_meta = {"format": "mmifeval", "tag": "P-Level", "question": "q", "answer_list": ["a"]}
    problems = {
        "c": EvalProblem("c", [{"role": "user", "content": "x"}], "", "mmifeval", _c_level()),
        "p": EvalProblem("p", [{"role": "user", "content": "x"}], "[\"a\"]", "mmifeval", p_meta),
    }
    samples = [{"id": "c", "response": "Hi.\n\nBye.", "gold": ""},
               {"id": "p", "response": "a", "gold": "[\"a\"]"}]
    scores = grade_samples("mmifeval", samples, problems, grade_workers=1)
    assert scores == [1.0, None]
    assert samples[0]["ungraded_constraints"] == 2 and samples[1]["ungraded_constraints"] == 1
    assert samples[0]["constraints"]["tone"] is None
    assert grade_samples("mmifeval", [dict(samples[1])], problems, grade_workers=1,
                         judge=lambda r: 1.0) == [1.0]
    # the record's grader decides: the same rows in a math benchmark are refused, not guessed
    with pytest.raises(ValueError, match=r"answer format\(s\) \['mmifeval'\]"):
        grade_samples("gsm8k", [dict(samples[0])], problems, grade_workers=1)
    assert mif.JUDGE_METHODS == ("direct_gpt", "cmp_gpt")
