"""Table 4 token statistics on a hand-built response whose counts are worked out below."""

from __future__ import annotations

import math

import pytest

from saopd.analysis.token_stats import (
    CONTENT,
    FUNCTION,
    FUNCTION_WORDS,
    NUMBER,
    PUNCT,
    REASONING_TEMPLATE_WORDS,
    TEMPLATE,
    classify_tokens,
    render_token_statistics,
    repeated_ngram,
    rows_from_ids,
    seen_before,
    token_frame,
    token_key,
    token_statistics,
    top_tokens,
)
from saopd.analysis.token_view import TokenRow
from tests.analysis.rendered import md_rows

# idx  token     category  key     seen before  bigram   trigram  unit in prompt
#  0   Let       template  let                                    no  (let's)
#  1   's        template  's                                     no
#  2   " find"   template  find                                   yes
#  3   " the"    function  the                                    yes
#  4   " area"   content   area                                   yes
#  5   "."       punct     .                                      yes
#  6   " The"    function  the     yes                            yes
#  7   " area"   content   area    yes          (the,area)        yes
#  8   " is"     function  is                                     no
#  9   " 12"     number    12                                     no
# 10   "."       punct     .       yes                            yes
# 11   "\n"      punct     \n                                     no
# 12   " The"    function  the     yes                            yes
# 13   " area"   content   area    yes          (the,area)        yes
# 14   " is"     function  is      yes          (area,is) (the,area,is)  no
# 15   " \\"     punct     \                                      no
# 16   "boxed"   punct (LaTeX command)                            no
# 17   "{"       punct                                            no
# 18   "12"      number    12      yes                            no
# 19   "}"       punct                                            no
TOKENS = ["Let", "'s", " find", " the", " area", ".", " The", " area", " is", " 12", ".", "\n",
          " The", " area", " is", " \\", "boxed", "{", "12", "}"]
PROMPT = "Find the area of a 3 by 4 rectangle."
CATS = [TEMPLATE, TEMPLATE, TEMPLATE, FUNCTION, CONTENT, PUNCT, FUNCTION, CONTENT, FUNCTION,
        NUMBER, PUNCT, PUNCT, FUNCTION, CONTENT, FUNCTION, PUNCT, PUNCT, PUNCT, NUMBER, PUNCT]
SEEN = {6, 7, 10, 12, 13, 14, 18}
BIGRAM = {7, 13, 14}
TRIGRAM = {14}
IN_PROMPT = {2, 3, 4, 5, 6, 7, 10, 12, 13}
FILTERED = {4, 5, 7, 13, 16, 18}  # area, ., area, area, boxed, 12


def _row(entropy: bool = False) -> TokenRow:
    n = len(TOKENS)
    return TokenRow(prompt=PROMPT, tokens=list(TOKENS), a_full=[0.1 * i for i in range(n)],
                    a_res=[0.0] * n, filtered=[i in FILTERED for i in range(n)],
                    entropy_student=[1.0] * n if entropy else None)


def test_word_lists_are_disjoint_lower_case_words() -> None:
    assert not FUNCTION_WORDS & REASONING_TEMPLATE_WORDS
    for word in FUNCTION_WORDS | REASONING_TEMPLATE_WORDS:
        assert word == word.lower() and " " not in word


def test_categories_by_hand() -> None:
    cats, units = classify_tokens(TOKENS)
    assert cats == CATS
    assert units[0] == units[1] == "let's"  # a split word is classified as a whole
    assert units[16] == "boxed"
    # a sub-word piece takes its whole word's category: "the" + "re" = "there" (function)
    assert classify_tokens([" the", "re", " cat"])[0] == [FUNCTION, FUNCTION, CONTENT]
    assert classify_tokens(["<|im_end|>", " 3.5", " x", "\u2019s"])[0][:3] == [PUNCT, NUMBER,
                                                                                  CONTENT]


def test_properties_by_hand() -> None:
    keys = [token_key(t) for t in TOKENS]
    assert keys[6] == "the" and keys[11] == "\n"
    assert {i for i, v in enumerate(seen_before(keys)) if v} == SEEN
    assert {i for i, v in enumerate(repeated_ngram(keys, 2)) if v} == BIGRAM
    assert {i for i, v in enumerate(repeated_ngram(keys, 3)) if v} == TRIGRAM
    frame = token_frame([_row()])
    assert set(frame.index[frame["seen_in_prompt"]]) == IN_PROMPT
    assert list(frame["category"]) == CATS
    assert frame["gap"].tolist() == pytest.approx([0.1 * i for i in range(len(TOKENS))])
    assert frame["entropy_student"].isna().all()
    with pytest.raises(ValueError):
        repeated_ngram(keys, 0)


def test_table4_counts_and_ratios() -> None:
    stats = token_statistics([_row()])
    n_f, n_k = len(FILTERED), len(TOKENS) - len(FILTERED)
    expected_f = {c: sum(1 for i in FILTERED if CATS[i] == c) for c in set(CATS)}
    expected_k = {c: sum(1 for i in range(len(TOKENS)) if i not in FILTERED and CATS[i] == c)
                  for c in set(CATS)}
    assert {c: v for c, v in expected_f.items() if v} == {CONTENT: 3, PUNCT: 2, NUMBER: 1}
    for cat in (CONTENT, PUNCT, FUNCTION, TEMPLATE, NUMBER):
        row = stats.loc[("All tokens", cat)]
        assert row["filtered"] == expected_f.get(cat, 0)
        assert row["kept"] == expected_k.get(cat, 0)
        assert row["filtered_ratio"] == pytest.approx(expected_f.get(cat, 0) / n_f)
        assert row["kept_ratio"] == pytest.approx(expected_k.get(cat, 0) / n_k)
    assert stats.loc[("All tokens", "total"), "filtered"] == n_f
    # filtered content tokens are 4, 7, 13: seen before 7, 13; in prompt all; bigram 7, 13
    content_f = [i for i in FILTERED if CATS[i] == CONTENT]
    for label, members in (("token seen before in the response", SEEN),
                           ("token seen in the prompt", IN_PROMPT),
                           ("in a repeated bigram", BIGRAM), ("in a repeated trigram", TRIGRAM)):
        row = stats.loc[("Content tokens", label)]
        count = sum(1 for i in content_f if i in members)
        assert row["filtered"] == count, label
        assert row["filtered_ratio"] == pytest.approx(count / n_f)  # the paper's convention
        assert row["filtered_of_content"] == pytest.approx(count / len(content_f))
        assert row["kept"] == 0 and math.isnan(row["kept_of_content"])  # no kept content


def test_rendered_table4_shows_counts_and_percentages() -> None:
    stats = token_statistics([_row()])
    md = render_token_statistics(stats, "markdown")
    n_f = len(FILTERED)
    rows = md_rows(md)
    assert rows["Content word"][1:3] == ["3", f"{100 * 3 / n_f:.1f}%"]
    assert rows["Token seen before in the response"][1] == "2"
    assert rows["*Content tokens*"][1:] == ["", "", "", ""]  # a section row: its label only
    tex = render_token_statistics(stats, "latex")
    assert r"\toprule" in tex and r"Content word & 3 & 50.0\% &" in tex
    assert r"\itshape Content tokens" in tex
    page = render_token_statistics(stats, "html")
    assert "<table" in page and "Reasoning-template word" in page
    with pytest.raises(ValueError, match="format"):
        render_token_statistics(stats, "rst")


def test_top_tokens_counts_filter_rate() -> None:
    top = top_tokens(token_frame([_row()]), 10)
    assert top.index[0] == "area"  # filtered 3 of 3 occurrences
    assert top.loc["area", "filtered"] == 3 and top.loc["area", "filter_rate"] == 1.0
    assert top.loc["12", "filter_rate"] == pytest.approx(0.5)
    assert "the" not in top.index  # never filtered


def test_rows_from_ids_with_a_real_tokenizer(tiny_tok) -> None:
    text = "So the answer is 42."
    ids = tiny_tok(text, add_special_tokens=False)["input_ids"]
    valid = [[True] * len(ids)]
    filtered = [[i == 0 for i in range(len(ids))]]
    rows = rows_from_ids(tiny_tok, ["What is 6 x 7?"], [ids], valid, filtered)
    frame = token_frame(rows)
    assert "".join(frame["token"]) == text
    assert frame["filtered"].sum() == 1
    assert {TEMPLATE, FUNCTION, NUMBER, PUNCT} <= set(frame["category"])


def test_bad_frame_is_refused() -> None:
    with pytest.raises(ValueError, match="lacks"):
        token_statistics(token_frame([_row()]).drop(columns=["category"]))
