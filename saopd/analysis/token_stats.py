"""Token statistics of filtered vs kept tokens: the paper's Table 4.

The paper (Sec. 4.4, Table 4) sorts the tokens SA-OPD filtered into categories (content word,
punctuation / format, function word, reasoning-template word, number) and, for content tokens,
counts how many were "seen before" or sit in a "repeated bigram" / "repeated trigram"; its ratios
are shares of *all* filtered tokens (1185 / 1967 = 60.2%). It gives no word lists or precise
definitions, so the ones used here are ours, stated below and in the constants of this module;
kept tokens are counted the same way, for comparison.

Categories (each token gets exactly one, tested in this order):

1. **punctuation / format**: a token without letters or digits (punctuation, symbols,
   whitespace, newlines, an empty string), a special token (``<|im_end|>``, ``<think>``,
   ``</s>``: :data:`SPECIAL_TOKEN`), or a LaTeX command word (letters right after a backslash:
   ``\\frac``, ``\\boxed``, ``\\text``).
2. **number**: a token with a digit and no letter (``3``, ``12``, ``.5``, ``1,``).
3. For a token with letters, the *word* it belongs to decides: the maximal run of letters
   (with inner apostrophes: ``let's``) in the response text that holds the token's first letter,
   lower-cased, so a sub-word piece is classified by its whole word (``the`` + ``re`` ->
   ``there``):

   - **reasoning-template word**: the word is in :data:`REASONING_TEMPLATE_WORDS`, the
     stereotyped words of step-by-step solutions (``step``, ``first``, ``therefore``,
     ``answer``, ``let's``, ``wait``, ...);
   - **function word**: the word is in :data:`FUNCTION_WORDS`, English closed-class words
     (articles, pronouns, prepositions, conjunctions, auxiliaries, determiners);
   - **content word**: any other word (nouns, verbs, adjectives, names, variables like ``x``).

   The two lists are disjoint; discourse connectives that open a reasoning step (``so``,
   ``then``, ``thus``, ``since``, ``because``, ``now``) count as template words.

Properties (computed for every token; the paper reports them for content tokens):

- **seen before in the response**: the token's key occurs at an earlier position of the same
  response. A key is the token text stripped of surrounding whitespace and lower-cased
  (``" The"`` and ``"the"`` share a key); a whitespace-only token is its own key.
- **seen in the prompt**: the token's *unit* occurs in the prompt. The unit is the word of
  category 3 for a token with letters, the whole number (digits with inner ``.``/``,``) for a
  digit token, and the stripped text otherwise; the prompt's units are its words, numbers, runs
  of punctuation and single punctuation characters (same rules, tokenizer-free).
- **repeated bigram / trigram**: the n tokens ending at this one (by key) already occurred as
  n consecutive tokens ending at an earlier position of the response: the token is predictable
  by copying from the prefix. The first n - 1 tokens of a response never qualify.

Input: :class:`~saopd.analysis.token_view.TokenRow` s (from ``token_rows_from_batch`` or a
:class:`~saopd.analysis.token_records.StepRecord`), or a tokenizer with ids and masks
(:func:`rows_from_ids`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import pandas as pd

from saopd.analysis.grid import Cell, Grid, grid_html, grid_latex, grid_markdown
from saopd.analysis.token_view import TokenRow, token_rows_from_batch

__all__ = [
    "CATEGORIES",
    "CONTENT",
    "FUNCTION",
    "FUNCTION_WORDS",
    "NUMBER",
    "PROPERTIES",
    "PUNCT",
    "REASONING_TEMPLATE_WORDS",
    "TEMPLATE",
    "classify_tokens",
    "prompt_units",
    "render_token_statistics",
    "repeated_ngram",
    "rows_from_ids",
    "seen_before",
    "token_frame",
    "token_key",
    "token_statistics",
    "token_statistics_grid",
    "top_tokens",
]

CONTENT = "content word"
PUNCT = "punctuation / format"
FUNCTION = "function word"
TEMPLATE = "reasoning-template word"
NUMBER = "number"
CATEGORIES = (CONTENT, PUNCT, FUNCTION, TEMPLATE, NUMBER)
"""Table 4's categories, in its row order."""

PROPERTIES = {
    "seen_before": "token seen before in the response",
    "seen_in_prompt": "token seen in the prompt",
    "repeated_bigram": "in a repeated bigram",
    "repeated_trigram": "in a repeated trigram",
}
"""Per-token properties (columns of :func:`token_frame`) and their Table 4 row names."""



def _words(text: str) -> frozenset[str]:
    """The whitespace-separated words of ``text``."""
    return frozenset(text.split())


FUNCTION_WORDS: frozenset[str] = _words("""
a an the
this that these those each every either neither some any no none all both few many much more
most less least other another such what which whose whatever whichever own same
i me my mine myself you your yours yourself yourselves he him his himself she her hers herself
it its itself we us our ours ourselves they them their theirs themselves one ones who whom
someone something anyone anything everyone everything nobody nothing
of in on at to for with by from into onto over under about above below between among through
during before after against without within along across behind beyond near off out up down
upon via per than toward towards around past until till except inside outside beside besides
and or but nor yet if although though while whereas unless whether as once either
be is am are was were been being have has had having do does did
will would shall should can could may might must ought
not never also just only very too even still again ever quite rather really
don't doesn't didn't isn't aren't wasn't weren't can't cannot couldn't won't wouldn't
shouldn't it's that's there's here's what's i'm i've i'd i'll we're we've we'll you're
they're he's she's
there here where when how why
""")
"""Closed-class English words: articles, determiners, pronouns, prepositions, conjunctions,
auxiliaries and a few adverbs. Disjoint from :data:`REASONING_TEMPLATE_WORDS`."""

REASONING_TEMPLATE_WORDS: frozenset[str] = _words("""
step steps first firstly second secondly third thirdly next then finally lastly
so thus hence therefore since because now
let let's lets
answer answers final solution solve solving find finding calculate calculating compute
computing determine recall note notice consider given check verify verifying conclude
conclusion summary wait hmm okay ok alright simplify simplifying substitute substituting
clearly obviously
""")
"""Words of stereotyped step-by-step reasoning ("Let's solve this step by step. First, ...
Therefore, the final answer is"). Disjoint from :data:`FUNCTION_WORDS`."""

SPECIAL_TOKEN = re.compile(r"^<\|?/?[A-Za-z0-9_.:\-|]*\|?>$")
"""Special tokens of chat templates (``<|im_end|>``, ``<|endoftext|>``, ``<think>``, ``</s>``)."""

_WORD = re.compile(r"[^\W\d_]+(?:['’][^\W\d_]+)*")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_PUNCT_RUN = re.compile(r"[^\w\s]+")


def token_key(text: str) -> str:
    """Stripped, lower-cased token text; a whitespace-only token keeps its text as its key."""
    stripped = text.strip().lower()
    return stripped if stripped else text


def classify_tokens(tokens: Sequence[str]) -> tuple[list[str], list[str]]:
    """Category and unit of each token of one response (see the module docstring).

    Returns ``(categories, units)``: one category of :data:`CATEGORIES` per token, and the
    unit (word, number or stripped text) used for prompt matching.
    """
    text = "".join(tokens)
    starts = []
    pos = 0
    for t in tokens:
        starts.append(pos)
        pos += len(t)
    word_at: list[tuple[int, int] | None] = [None] * len(text)  # char -> its word's span
    for m in _WORD.finditer(text):
        for i in range(m.start(), m.end()):
            word_at[i] = (m.start(), m.end())
    number_at: list[tuple[int, int] | None] = [None] * len(text)
    for m in _NUMBER.finditer(text):
        for i in range(m.start(), m.end()):
            number_at[i] = (m.start(), m.end())

    categories, units = [], []
    for tok, start in zip(tokens, starts, strict=True):
        stripped = tok.strip()
        letter = next((i for i, ch in enumerate(tok) if ch.isalpha()), None)
        digit = next((i for i, ch in enumerate(tok) if ch.isdigit()), None)
        if stripped and SPECIAL_TOKEN.match(stripped):
            categories.append(PUNCT)
            units.append(stripped)
        elif letter is not None and word_at[start + letter] is not None:
            w0, w1 = word_at[start + letter]  # type: ignore[misc]
            word = text[w0:w1].lower().replace("’", "'")
            units.append(word)
            if w0 > 0 and text[w0 - 1] == "\\":
                categories.append(PUNCT)  # a LaTeX command: layout, not language
            elif word in REASONING_TEMPLATE_WORDS:
                categories.append(TEMPLATE)
            elif word in FUNCTION_WORDS:
                categories.append(FUNCTION)
            else:
                categories.append(CONTENT)
        elif digit is not None:
            categories.append(NUMBER)
            span = number_at[start + digit]
            units.append(text[span[0]:span[1]] if span else stripped)
        else:
            categories.append(PUNCT)
            units.append(stripped.lower() if stripped else tok)
    return categories, units


def seen_before(keys: Sequence[str]) -> list[bool]:
    """True where the key already occurred at an earlier position."""
    seen: set[str] = set()
    out = []
    for k in keys:
        out.append(k in seen)
        seen.add(k)
    return out


def repeated_ngram(keys: Sequence[str], n: int) -> list[bool]:
    """True where the n keys ending here occurred, consecutively, ending at an earlier position."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    seen: set[tuple[str, ...]] = set()
    out = []
    for t in range(len(keys)):
        if t + 1 < n:
            out.append(False)
            continue
        gram = tuple(keys[t + 1 - n: t + 1])
        out.append(gram in seen)
        seen.add(gram)
    return out


def prompt_units(prompt: str) -> set[str]:
    """The prompt's words (lower-cased), numbers, punctuation runs and punctuation characters."""
    units = {m.group().lower().replace("’", "'") for m in _WORD.finditer(prompt)}
    units |= {m.group() for m in _NUMBER.finditer(prompt)}
    for m in _PUNCT_RUN.finditer(prompt):
        units.add(m.group())
        units.update(m.group())
    return units


def token_frame(rows: Iterable[TokenRow], *, step: int | None = None) -> pd.DataFrame:
    """One row per token of ``rows``: its text, category and properties, and its signals.

    Columns: ``step`` (when given), ``response``, ``position``, ``token``, ``key``, ``unit``,
    ``category``, ``seen_before``, ``seen_in_prompt``, ``repeated_bigram``,
    ``repeated_trigram``, ``filtered``, ``a_full``, ``a_res``, ``gap`` (|A_full - A_res|) and
    ``entropy_student`` (NaN where absent).
    """
    records = []
    nan = float("nan")
    for r, row in enumerate(rows):
        keys = [token_key(t) for t in row.tokens]
        categories, units = classify_tokens(row.tokens)
        before = seen_before(keys)
        bigram, trigram = repeated_ngram(keys, 2), repeated_ngram(keys, 3)
        in_prompt = prompt_units(row.prompt)
        gap = row.gap
        for t, tok in enumerate(row.tokens):
            records.append({
                "response": r, "position": t, "token": tok, "key": keys[t], "unit": units[t],
                "category": categories[t], "seen_before": before[t],
                "seen_in_prompt": units[t] in in_prompt, "repeated_bigram": bigram[t],
                "repeated_trigram": trigram[t], "filtered": bool(row.filtered[t]),
                "a_full": float(row.a_full[t]),
                "a_res": nan if row.a_res is None else float(row.a_res[t]),
                "gap": nan if gap is None else float(gap[t]),
                "entropy_student": nan if row.entropy_student is None
                else float(row.entropy_student[t]),
            })
    columns = ["response", "position", "token", "key", "unit", "category", *PROPERTIES,
               "filtered", "a_full", "a_res", "gap", "entropy_student"]
    frame = pd.DataFrame.from_records(records, columns=columns)
    if step is not None:
        frame.insert(0, "step", step)
    return frame


def rows_from_ids(tokenizer: Any, prompts: list[str], response_ids: Any, valid: Any,
                  filtered: Any) -> list[TokenRow]:
    """Rows for :func:`token_frame` from a tokenizer, ids [B, R], valid and filtered masks
    [B, R] (no signals: A_full is 0, A_res absent)."""
    zeros = [[0.0] * len(r) for r in (valid.tolist() if hasattr(valid, "tolist") else valid)]
    return token_rows_from_batch(tokenizer, prompts, response_ids, valid, zeros, None, filtered,
                                 max_rows=None)


def token_statistics(tokens: pd.DataFrame | Iterable[TokenRow]) -> pd.DataFrame:
    """Table 4 for filtered and kept tokens.

    Args:
        tokens: a :func:`token_frame`, or rows to build one from.

    Returns a frame indexed by ``(section, row)`` with columns ``filtered``,
    ``filtered_ratio``, ``kept``, ``kept_ratio``. Section ``All tokens``: one row per category
    (count, share of the group's tokens) and ``total``. Section ``Content tokens``: content
    tokens with each property; the ratio is, as in the paper, over *all* tokens of the group
    (filtered or kept), and ``*_of_content`` columns give the share of the group's content
    tokens. A group with no token has ratio NaN.
    """
    frame = tokens if isinstance(tokens, pd.DataFrame) else token_frame(tokens)
    need = {"category", "filtered", *PROPERTIES}
    if not need <= set(frame.columns):
        raise ValueError(f"token frame lacks column(s) {sorted(need - set(frame.columns))}")
    out: dict[tuple[str, str], dict[str, float]] = {}
    groups = {"filtered": frame[frame["filtered"].astype(bool)],
              "kept": frame[~frame["filtered"].astype(bool)]}
    for name, g in groups.items():
        total = len(g)
        content = g[g["category"] == CONTENT]
        for cat in CATEGORIES:
            c = int((g["category"] == cat).sum())
            out.setdefault(("All tokens", cat), {})[name] = c
            out[("All tokens", cat)][f"{name}_ratio"] = c / total if total else float("nan")
        out.setdefault(("All tokens", "total"), {})[name] = total
        out[("All tokens", "total")][f"{name}_ratio"] = 1.0 if total else float("nan")
        for prop, label in PROPERTIES.items():
            c = int(content[prop].astype(bool).sum())
            row = out.setdefault(("Content tokens", label), {})
            row[name] = c
            row[f"{name}_ratio"] = c / total if total else float("nan")
            row[f"{name}_of_content"] = c / len(content) if len(content) else float("nan")
    table = pd.DataFrame.from_dict(out, orient="index")
    table.index = pd.MultiIndex.from_tuples(table.index, names=["section", "row"])
    cols = ["filtered", "filtered_ratio", "filtered_of_content", "kept", "kept_ratio",
            "kept_of_content"]
    table = table.reindex(columns=cols)
    for c in ("filtered", "kept"):
        table[c] = table[c].astype(int)
    return table


def token_statistics_grid(stats: pd.DataFrame, *, caption: str | None = None) -> Grid:
    """Table 4 (from :func:`token_statistics`) as a :class:`~saopd.analysis.grid.Grid`, for
    :func:`~saopd.analysis.grid.grid_markdown`, ``grid_latex`` or ``grid_html``."""
    def pct(x: float) -> str:
        return "–" if pd.isna(x) else f"{100 * x:.1f}%"

    header = ["Category / Property", "Filtered", "Ratio", "Kept", "Ratio"]
    rows: list[list[Cell]] = []
    classes: list[str] = []
    rules: set[int] = set()
    titles = {"All tokens": "All tokens", "Content tokens": "Content tokens"}
    for section in dict.fromkeys(stats.index.get_level_values(0)):
        if rows:
            rules.add(len(rows))
        rows.append([Cell(titles.get(section, section))] + [Cell("")] * 4)
        classes.append("section")
        for (_, name), r in stats.loc[[section]].iterrows():
            label = name[0].upper() + name[1:]
            rows.append([Cell(label), Cell(str(int(r["filtered"]))),
                         Cell(pct(r["filtered_ratio"])), Cell(str(int(r["kept"]))),
                         Cell(pct(r["kept_ratio"]))])
            classes.append("method")
    notes = ["Ratios are shares of all filtered (kept) tokens, content-token rows included, "
             "as in the paper's Table 4."]
    return Grid(header=header, rows=rows, rules=rules, row_classes=classes,
                caption=caption or "Token-level statistics of filtered and kept tokens",
                notes=notes)


def render_token_statistics(stats: pd.DataFrame, fmt: str, *, caption: str | None = None) -> str:
    """Table 4 as ``markdown``, ``latex`` or ``html`` (a complete page)."""
    grid = token_statistics_grid(stats, caption=caption)
    if fmt == "markdown":
        return grid_markdown(grid)
    if fmt == "latex":
        return grid_latex(grid, label="tab:token_analysis")
    if fmt == "html":
        return grid_html(grid)
    raise ValueError(f"format must be markdown, latex or html, got {fmt!r}")


def top_tokens(tokens: pd.DataFrame, n: int = 20, *, by: str = "key") -> pd.DataFrame:
    """The ``n`` most frequently filtered keys (or units/categories: ``by``), with how often
    each occurred in all and the share of its occurrences that were filtered (``filter_rate``)."""
    if by not in tokens.columns:
        raise ValueError(f"token frame has no column {by!r}")
    g = tokens.groupby(by)["filtered"].agg(filtered="sum", occurrences="size")
    g["filtered"] = g["filtered"].astype(int)
    g["filter_rate"] = g["filtered"] / g["occurrences"]
    cats = tokens.groupby(by)["category"].agg(lambda s: s.mode().iat[0])
    g["category"] = cats
    g = g[g["filtered"] > 0].sort_values(["filtered", "filter_rate"], ascending=False)
    return g.head(n)
