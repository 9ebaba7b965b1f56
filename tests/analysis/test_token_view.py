"""The filtered-token HTML view: escaping, one span per valid token, outlines only on F, legend."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest
import torch

from saopd.analysis import (
    TokenRow,
    render_token_view,
    rows_stats,
    token_rows_from_batch,
    token_rows_from_signals,
)
from saopd.filters import FILTERS
from saopd.models import tiny_tokenizer
from tests.conftest import hand_signals  # the hand-made batch of tests/conftest.py

VOID = {"br", "meta", "hr", "img", "input", "link", "wbr"}


class _Collector(HTMLParser):
    """Checks tag balance and records every token span (class, title, text)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.tokens: list[dict[str, str]] = []
        self.tags: set[str] = set()
        self._tok_depth: int | None = None  # stack depth of the open token span

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        if tag in VOID:
            if self._tok_depth is not None and tag == "br":
                self.tokens[-1]["text"] += "<BR>"
            return
        self.stack.append(tag)
        a = {k: v or "" for k, v in attrs}
        if tag == "span" and "tok" in a.get("class", "").split() and self._tok_depth is None:
            self.tokens.append({"class": a["class"], "title": a.get("title", ""),
                                "style": a.get("style", ""), "text": ""})
            self._tok_depth = len(self.stack)

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"unbalanced </{tag}>, open: {self.stack}")
            return
        if self._tok_depth == len(self.stack):
            self._tok_depth = None
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        if self._tok_depth is not None:
            self.tokens[-1]["text"] += data


def parse(page: str) -> _Collector:
    p = _Collector()
    p.feed(page)
    p.close()
    assert not p.errors, p.errors
    assert p.stack == [], f"unclosed tags: {p.stack}"
    return p


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _batch(tok, texts: list[str], seed: int = 0):
    """Right-padded response ids with a valid mask, random A_full/A_res, and a filtered mask."""
    enc = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    length = max(len(e) for e in enc) + 2
    ids = torch.full((len(enc), length), 3)
    valid = torch.zeros(len(enc), length, dtype=torch.bool)
    for b, e in enumerate(enc):
        ids[b, : len(e)] = torch.tensor(e)
        valid[b, : len(e)] = True
    g = torch.Generator().manual_seed(seed)
    a_full = 4 * torch.randn(ids.shape, generator=g)
    a_res = a_full + torch.randn(ids.shape, generator=g)
    filtered = (torch.rand(ids.shape, generator=g) < 0.3) & valid
    return ids, valid, a_full, a_res, filtered


TEXTS = [
    "Alice has <script>alert('x')</script> 3 apples & \"quotes\".\n\nSo the answer is 3.",
    "Zoë buys\tpencils.\r\nThen   finally<|im_end|>",
    "short",
]
PROMPTS = ["<b>What</b> is 1+1?", "Q: <script>bad()</script>\nsecond line", "x" * 1000]


def test_rows_from_batch_decode_tokens_faithfully(tok):
    ids, valid, a_full, a_res, filtered = _batch(tok, TEXTS)
    rows = token_rows_from_batch(tok, PROMPTS, ids, valid, a_full, a_res, filtered)
    assert len(rows) == 3
    for b, row in enumerate(rows):
        assert "".join(row.tokens) == TEXTS[b]  # byte-level BPE spaces/newlines round-trip
        assert len(row.tokens) == int(valid[b].sum())
        assert row.filtered == filtered[b][valid[b]].tolist()
        assert row.a_full == pytest.approx(a_full[b][valid[b]].tolist())
        assert row.gap == pytest.approx((a_full - a_res)[b][valid[b]].abs().tolist())
    assert token_rows_from_batch(tok, PROMPTS, ids, valid, a_full, None, filtered,
                                 max_rows=2)[1].a_res is None
    assert len(token_rows_from_batch(tok, PROMPTS, ids, valid, a_full, a_res, filtered,
                                     max_rows=2)) == 2


def test_rows_from_batch_rejects_mismatched_shapes(tok):
    ids, valid, a_full, a_res, filtered = _batch(tok, TEXTS)
    with pytest.raises(ValueError, match="a_full"):
        token_rows_from_batch(tok, PROMPTS, ids, valid, a_full[:, :-1], a_res, filtered)
    with pytest.raises(ValueError, match="prompts"):
        token_rows_from_batch(tok, PROMPTS[:2], ids, valid, a_full, a_res, filtered)
    with pytest.raises(ValueError, match="field lengths"):
        TokenRow(prompt="", tokens=["a"], a_full=[1.0, 2.0], a_res=None, filtered=[False])


def test_render_spans_outlines_and_escaping(tok):
    ids, valid, a_full, a_res, filtered = _batch(tok, TEXTS)
    rows = token_rows_from_batch(tok, PROMPTS, ids, valid, a_full, a_res, filtered)
    page = render_token_view(rows, title="step <7>", step=7, filter_name="sa_opd")
    p = parse(page)

    # nothing from the data reaches the page unescaped
    assert "<script" not in page and "<b>What" not in page
    assert "&lt;script&gt;" in page and "&lt;b&gt;What" in page
    assert "script" not in p.tags
    assert "step &lt;7&gt;" in page

    # one token span per valid token, in order; outline class exactly on the filtered ones
    assert len(p.tokens) == int(valid.sum())
    flat_filtered = [f for r in rows for f in r.filtered]
    assert ["flt" in t["class"].split() for t in p.tokens] == flat_filtered
    assert sum(flat_filtered) > 0 and not all(flat_filtered)
    assert page.count('class="tok flt"') == sum(flat_filtered)

    # text of the spans reproduces the responses; newlines are a visible mark plus a line break
    texts = [t["text"] for t in p.tokens]
    joined = "".join(texts)
    assert "\u21b5<BR>\u21b5<BR>So the answer" in joined
    assert "\n" not in joined  # raw newlines never reach the pre-wrap block
    assert "Zoë buys\tpencils.\u240d\u21b5<BR>Then   finally<|im_end|>" in joined

    # hover title: token | A_full | A_res | gap | filtered
    flat_a = [a for r in rows for a in r.a_full]
    for t, a, f in zip(p.tokens, flat_a, flat_filtered, strict=True):
        parts = t["title"].split(" | ")
        assert len(parts) == 5
        assert parts[1] == f"A_full {a:+.3f}"
        assert parts[2].startswith("A_res ") and parts[3].startswith("gap ")
        assert parts[4] == ("filtered" if f else "kept")

    # prompt truncated in the middle
    assert "x" * 1000 not in page and "[600 chars]" in page


def test_colours_follow_the_sign_of_a_full():
    row = TokenRow(prompt="p", tokens=["a", "b", "c"], a_full=[3.0, -3.0, 0.0], a_res=None,
                   filtered=[False, True, False])
    page = render_token_view([row], title="t", vmax=3.0)
    assert "saturate at |A<sub>full</sub>| = 3." in page
    p = parse(page)
    bgs = [re.search(r"background:#([0-9a-f]{6})", t["style"]).group(1) for t in p.tokens]
    rgb = [tuple(int(h[i:i + 2], 16) for i in (0, 2, 4)) for h in bgs]
    assert rgb[0] == (178, 24, 43)  # red: student over-confident
    assert rgb[1] == (33, 102, 172)  # blue
    assert rgb[2] == (247, 247, 247)  # neutral
    assert "n/a" in p.tokens[0]["title"]  # no residual pass


def test_legend_and_stats_in_header(tok):
    ids, valid, a_full, a_res, filtered = _batch(tok, TEXTS)
    rows = token_rows_from_batch(tok, PROMPTS, ids, valid, a_full, a_res, filtered)
    stats = {"flmr": 0.125, "filtered_ratio": 0.25, "grounding_gap_filtered": 0.0312,
             "grounding_gap_kept": 1.5, "n_valid": 40.0, "custom<key>": 2.5}
    page = render_token_view(rows, title="t", stats=stats, step=12, filter_name="sa_opd")
    parse(page)
    assert 'class="legend"' in page and "linear-gradient" in page
    assert "Red" in page and "Blue" in page and 'class="flt-sample"' in page
    for text in ("FLMR", "0.125", "filtered ratio", "0.25", "mean gap (filtered)", "0.0312",
                 "mean gap (kept)", "1.5", "valid tokens", "40", "custom&lt;key&gt;",
                 "step <b>12</b>", "filter <b>sa_opd</b>", "batch statistics"):
        assert text in page, text
    # without given stats: computed over the rows shown
    page = render_token_view(rows, title="t")
    assert "statistics over the responses shown" in page and "FLMR" in page
    assert "<script" not in page and "http" not in page  # self-contained: no external assets


def test_rows_stats_match_filter_stats():
    signals = hand_signals()
    result = FILTERS.build("sa_opd", p1=0.5, p2=0.5)(signals)
    ids = torch.arange(signals.valid.numel()).view_as(signals.valid) + 10

    class _Tok:  # a stand-in tokenizer: ids as text
        def convert_ids_to_tokens(self, ids):
            return [f"t{i}" for i in ids]

        def convert_tokens_to_string(self, toks):
            return "".join(toks)

    rows = token_rows_from_signals(_Tok(), ["p"], ids, signals, result)
    got = rows_stats(rows)
    for key, value in result.stats.items():
        if key in got:
            assert got[key] == pytest.approx(value, abs=1e-6), key
    assert set(got) >= {"flmr", "filtered_ratio", "grounding_gap_filtered", "grounding_gap_kept"}


def test_empty_inputs_render():
    page = render_token_view([], title="nothing")
    parse(page)
    row = TokenRow(prompt="", tokens=[""], a_full=[float("inf")], a_res=[0.0], filtered=[True])
    p = parse(render_token_view([row], title="t"))
    assert len(p.tokens) == 1 and "\u2205" in p.tokens[0]["text"]
