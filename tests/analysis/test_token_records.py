"""Per-step token records: from a training step's view, to disk and back; the annotated view."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import pytest
import torch

from saopd.analysis.token_records import (
    StepView,
    find_record_dirs,
    load_step_record,
    load_step_records,
    prompt_text,
    record_path,
    save_step_record,
    step_record_from_view,
)
from saopd.analysis.token_view import render_token_view

TEXTS = ["The answer is 4.", "Let's add: 2 + 2\n= 4"]


def _view(tok, *, entropy: bool = True, residual: bool = True) -> StepView:
    """What a training step returns as its ``view``: right-padded [B, R] tensors."""
    enc = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    length = max(map(len, enc)) + 3
    ids = torch.zeros(len(enc), length, dtype=torch.long)
    valid = torch.zeros(len(enc), length, dtype=torch.bool)
    for b, e in enumerate(enc):
        ids[b, : len(e)] = torch.tensor(e)
        valid[b, : len(e)] = True
    g = torch.Generator().manual_seed(0)
    a_full = torch.randn(ids.shape, generator=g)
    view = {
        "step": 0,
        "messages": [[{"role": "user", "content": "What is 2+2?"}],
                     [{"role": "system", "content": "sys"},
                      {"role": "user", "content": [{"type": "image"},
                                                   {"type": "text", "text": "Add them."}]}]],
        "response_ids": ids, "valid": valid, "a_full": a_full,
        "a_res": a_full + torch.randn(ids.shape, generator=g) if residual else None,
        "filtered": (torch.rand(ids.shape, generator=g) < 0.4) & valid,
        "stats": {"flmr": 0.25, "filtered_ratio": 0.4},
    }
    if entropy:
        view["entropy_student"] = 3 * torch.rand(ids.shape, generator=g)
    return StepView(**view)


def test_prompt_text_handles_multimodal_content() -> None:
    assert prompt_text([{"role": "user", "content": "hi"}]) == "hi"
    assert prompt_text([{"role": "user", "content": [{"type": "image"},
                                                     {"type": "text", "text": "x"}]}]) \
        == "<image>x"
    assert prompt_text([]) == ""


@pytest.mark.parametrize("compress", [True, False])
def test_record_round_trip(tiny_tok, tmp_path: Path, compress: bool) -> None:
    view = _view(tiny_tok)
    rec = step_record_from_view(view, tiny_tok, step=7, filter_name="sa_opd")
    # without a step, the record takes the view's own
    assert step_record_from_view(dataclasses.replace(view, step=11), tiny_tok).step == 11
    assert [len(r.response_ids) for r in rec.responses] == view.valid.sum(-1).tolist()
    assert ["".join(r.tokens) for r in rec.responses] == TEXTS
    assert rec.responses[1].prompt == "<image>Add them."
    path = save_step_record(rec, record_path(tmp_path, 7, compress=compress))
    assert path.name == ("step_000007.jsonl.gz" if compress else "step_000007.jsonl")
    if compress:
        with gzip.open(path, "rt") as fh:
            assert json.loads(fh.readline())["kind"] == "header"
    back = load_step_record(path)
    assert back.step == 7 and back.filter_name == "sa_opd" and back.stats == rec.stats
    assert back.has_entropy
    for b, (r, orig) in enumerate(zip(back.responses, rec.responses, strict=True)):
        mask = view.valid[b]
        assert r.response_ids == view.response_ids[b][mask].tolist()
        assert r.filtered == view.filtered[b][mask].tolist()
        assert r.a_full == pytest.approx(view.a_full[b][mask].tolist(), rel=1e-5, abs=1e-6)
        assert r.a_res == pytest.approx(view.a_res[b][mask].tolist(), rel=1e-5, abs=1e-6)
        assert r.entropy_student == pytest.approx(orig.entropy_student, rel=1e-5, abs=1e-6)
    rows = back.rows()
    assert rows[0].gap == pytest.approx(
        (view.a_full - view.a_res)[0][view.valid[0]].abs().tolist(), rel=1e-4,
        abs=1e-5)


def test_record_without_tokenizer_residual_or_entropy(tiny_tok, tmp_path: Path) -> None:
    view = _view(tiny_tok, entropy=False, residual=False)
    rec = step_record_from_view(view, None, step=0, max_rows=1)
    assert len(rec.responses) == 1 and rec.responses[0].tokens is None
    back = load_step_record(save_step_record(rec, tmp_path / "step_000000.jsonl"))
    assert back.responses[0].a_res is None and not back.has_entropy
    with pytest.raises(ValueError, match="tokenizer"):
        back.rows()
    assert "".join(back.rows(tiny_tok)[0].tokens) == TEXTS[0]


def test_loading_folders_and_bad_files(tiny_tok, tmp_path: Path) -> None:
    run = tmp_path / "outputs" / "tiny" / "run1"
    for step in (4, 1, 9):
        rec = step_record_from_view(_view(tiny_tok), tiny_tok, step=step)
        save_step_record(rec, record_path(run / "token_records", step))
    assert [r.step for r in load_step_records(run)] == [1, 4, 9]  # run folder or the records'
    assert [r.step for r in load_step_records(run / "token_records", steps=[4])] == [4]
    assert find_record_dirs(tmp_path / "outputs") == [run / "token_records"]
    with pytest.raises(FileNotFoundError, match="no token records"):
        load_step_records(tmp_path / "empty")

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "response"}\n')
    with pytest.raises(ValueError, match="line 1 is not a token-record header"):
        load_step_record(bad)
    bad.write_text('{"kind": "header", "version": 1, "step": 0}\n{"kind": "response", '
                   '"response_ids": [1, 2], "a_full": [0.1], "filtered": [0, 1]}\n')
    with pytest.raises(ValueError, match="line 2"):
        load_step_record(bad)
    bad.write_text('{"kind": "header", "version": 99, "step": 0}\n')
    with pytest.raises(ValueError, match="version 99"):
        load_step_record(bad)
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        load_step_record(bad)


def test_annotated_view_shows_a_full_and_gap_under_each_token(tiny_tok) -> None:
    rows = step_record_from_view(_view(tiny_tok), tiny_tok, step=3).rows()
    page = render_token_view(rows, title="t", annotate=True)
    n_tokens = sum(len(r.tokens) for r in rows)
    assert page.count('<span class="av">') == n_tokens
    for r in rows:
        gap = r.gap
        for t, a in enumerate(r.a_full):
            assert f"F {a:+.2f}<br>&Delta; {gap[t]:.2f}" in page
    n_filtered = sum(sum(r.filtered) for r in rows)
    assert page.count('class="tok flt ann"') == n_filtered
    assert "| H_S " in page  # entropy in the tooltip when the rows carry it
    # the newline of the second response: a visible mark in the box, the break after the box
    assert "\u21b5</span>" in page and "</span></span><br>" in page
    plain = render_token_view(rows, title="t")
    assert 'class="av"' not in plain
