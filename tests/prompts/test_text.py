"""Prompt data: vendored GSM8K files (hashes, row counts, gold answers), JSONL error reporting,
records, collation, the resumable sampler and long-prompt filtering."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from saopd.config.data import GSM8K_INSTRUCTION
from saopd.models import tiny_tokenizer
from saopd.prompts.render import render_prompt_ids
from saopd.prompts.text import (
    GSM8K_DIR,
    PromptDataset,
    PromptRecord,
    PromptSampler,
    collate_prompts,
    filter_long_prompts,
    gsm8k_answer,
    gsm8k_path,
    gsm8k_records,
    load_jsonl,
)

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data" / "gsm8k"


def _provenance_table() -> dict[str, dict[str, str]]:
    """file -> {rows, bytes, sha256} parsed from data/gsm8k/PROVENANCE.md."""
    out = {}
    for line in (DATA / "PROVENANCE.md").read_text().splitlines():
        m = re.match(
            r"\|\s*(\w+\.jsonl)\s*\|.*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*([0-9a-f]{64})\s*\|$", line
        )
        if m:
            out[m[1]] = {"rows": m[2], "bytes": m[3], "sha256": m[4]}
    return out


def _write(tmp_path: Path, name: str, lines: list[str]) -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _row(q: str = "What is 1+1?", a: str = "1+1=2\n#### 2") -> str:
    return json.dumps({"question": q, "answer": a})


# ---------------------------------------------------------------------------- vendored files


def test_vendored_files_match_provenance() -> None:
    table = _provenance_table()
    assert set(table) == {"train.jsonl", "test.jsonl"}
    assert table["train.jsonl"]["rows"] == "7473"
    assert table["test.jsonl"]["rows"] == "1319"
    for name, meta in table.items():
        data = (DATA / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == meta["sha256"], name
        assert len(data) == int(meta["bytes"]), name
    lic = (DATA / "LICENSE").read_text()
    assert lic.startswith("MIT License") and "OpenAI" in lic
    assert (
        "86bbb73e855821d7c401912fd4bf82e34313e6e3b6fd6f909f2b6cc9e209a53b"
        in (DATA / "PROVENANCE.md").read_text()
    )
    assert hashlib.sha256((DATA / "LICENSE").read_bytes()).hexdigest() == (
        "86bbb73e855821d7c401912fd4bf82e34313e6e3b6fd6f909f2b6cc9e209a53b"
    )


@pytest.mark.parametrize(("split", "n"), [("train", 7473), ("test", 1319)])
def test_row_counts_and_records(split: str, n: int) -> None:
    path = gsm8k_path(split)
    assert path == GSM8K_DIR / f"{split}.jsonl" == DATA / f"{split}.jsonl"
    rows, report = load_jsonl(path)
    assert len(rows) == report.rows == n and report.skipped == 0 and report.errors == []
    assert all(set(r) == {"question", "answer"} for r in rows)
    records, rep = gsm8k_records(path)
    assert len(records) == rep.rows == n and rep.skipped == 0
    assert len({r.id for r in records}) == n
    assert records[0].id == f"gsm8k-{split}-1" and records[-1].id == f"gsm8k-{split}-{n}"
    # every GSM8K gold answer is an integer once thousands separators are dropped
    assert all(re.fullmatch(r"-?\d+", r.answer or "") for r in records)


def test_gsm8k_answers_hand_picked() -> None:
    train, _ = gsm8k_records(gsm8k_path("train"))
    test, _ = gsm8k_records(gsm8k_path("test"))
    by_id = {r.id: r for r in train + test}
    expected = {
        "gsm8k-train-1": ("Natalia sold clips to 48 of her friends", "72"),
        "gsm8k-train-2": ("Weng earns $12 an hour", "10"),
        "gsm8k-train-3": ("Betty is saving money for a new wallet", "5"),
        "gsm8k-train-346": (None, "1080"),  # "#### 1,080"
        "gsm8k-train-645": (None, "109200000"),  # "#### 109,200,000"
        "gsm8k-test-147": (None, "2125"),  # "#### 2,125"
        "gsm8k-test-612": (None, "1450000"),  # "#### 1,450,000"
    }
    raw_train = (DATA / "train.jsonl").read_text().splitlines()
    raw_test = (DATA / "test.jsonl").read_text().splitlines()
    for rid, (q_start, gold) in expected.items():
        rec = by_id[rid]
        assert rec.answer == gold, rid
        assert rec.source == "gsm8k"
        split, line = rid.split("-")[1], int(rid.split("-")[2])
        raw = json.loads((raw_train if split == "train" else raw_test)[line - 1])
        assert rec.messages == [
            {"role": "user", "content": f"{raw['question']} {GSM8K_INSTRUCTION}"}
        ]
        if q_start:
            assert raw["question"].startswith(q_start)
        if "," in raw["answer"].rsplit("####", 1)[1]:
            assert "," not in gold


def test_gsm8k_answer_extraction() -> None:
    assert gsm8k_answer("a\nb #### 1,000") == "1000"
    assert gsm8k_answer("x #### y #### -5 ") == "-5"
    assert gsm8k_answer("####12") == "12"
    with pytest.raises(ValueError, match="no '####'"):
        gsm8k_answer("the answer is 3")
    with pytest.raises(ValueError, match="empty"):
        gsm8k_answer("3 ####  ")


def test_gsm8k_records_options(tmp_path: Path) -> None:
    path = _write(tmp_path, "dev.jsonl", [_row("Q1? ", "#### 1"), "", _row("Q2?", "#### 2,5")])
    recs, rep = gsm8k_records(path, system_prompt="Be brief.", instruction=None, split="val")
    assert rep.rows == 2
    assert [r.id for r in recs] == ["gsm8k-val-1", "gsm8k-val-3"]  # blank line 2 still counts
    assert recs[0].messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q1?"},
    ]
    assert [r.answer for r in recs] == ["1", "25"]
    recs, _ = gsm8k_records(path, instruction="Answer:")
    assert recs[1].id == "gsm8k-dev-3" and recs[1].messages[-1]["content"] == "Q2? Answer:"
    recs, rep = gsm8k_records(path, limit=1)
    assert len(recs) == rep.rows == 1
    assert gsm8k_records(path, limit=0)[0] == []
    with pytest.raises(ValueError, match="limit"):
        gsm8k_records(path, limit=-1)
    full, _ = gsm8k_records(gsm8k_path("train"), limit=3)
    assert [r.answer for r in full] == ["72", "10", "5"]


# -------------------------------------------------------------------------------- bad input


def test_bad_json_line_names_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "bad.jsonl", [_row(), "", _row(), '{"question": "x", "answer"', _row()])
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}:4: invalid JSON"):
        load_jsonl(path)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}:4: invalid JSON"):
        gsm8k_records(path)
    rows, rep = load_jsonl(path, skip_bad=True)
    assert len(rows) == rep.rows == 3 and rep.skipped == 1
    assert len(rep.errors) == 1 and rep.errors[0].startswith(f"{path}:4: invalid JSON")


def test_non_object_and_undecodable_lines(tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b'[1, 2]\n"text"\n{"a": 1}\n\xff\xfe{}\n  \n42\n')
    with pytest.raises(ValueError, match=r"mixed\.jsonl:1: expected a JSON object, got list"):
        load_jsonl(path)
    rows, rep = load_jsonl(path, skip_bad=True)
    assert rows == [{"a": 1}] and rep.rows == 1 and rep.skipped == 4
    assert [e.split(": ")[0].rsplit(":", 1)[1] for e in rep.errors] == ["1", "2", "4", "6"]
    assert "not valid UTF-8" in rep.errors[2]


def test_blank_lines_and_bom_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\n\n   \n{"a": 2}')  # no trailing newline
    rows, rep = load_jsonl(path)
    assert rows == [{"a": 1}, {"a": 2}] and rep.skipped == 0


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"question": "Q?"}, "missing or empty"),
        ({"answer": "#### 3"}, "missing or empty"),
        ({"question": "", "answer": "#### 3"}, "missing or empty"),
        ({"question": "Q?", "answer": 3}, "missing or empty"),
        ({"question": "Q?", "answer": "three"}, "the answer has no '####'"),
    ],
)
def test_missing_fields(tmp_path: Path, row: dict, reason: str) -> None:
    path = _write(tmp_path, "train.jsonl", [_row(), json.dumps(row), _row()])
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}:2: {reason}"):
        gsm8k_records(path)
    recs, rep = gsm8k_records(path, skip_bad=True)
    assert [r.id for r in recs] == ["gsm8k-train-1", "gsm8k-train-3"]
    assert rep.rows == 2 and rep.skipped == 1 and rep.errors[0].startswith(f"{path}:2: ")


def test_skip_bad_counts_mixed_errors(tmp_path: Path) -> None:
    path = _write(
        tmp_path, "train.jsonl", [_row(), "not json", json.dumps({"q": 1}), "[]", _row(), "{"]
    )
    recs, rep = gsm8k_records(path, skip_bad=True)
    assert [r.id for r in recs] == ["gsm8k-train-1", "gsm8k-train-5"]
    assert rep.rows == 2 and rep.skipped == 4 and len(rep.errors) == 4
    assert [int(e.split(": ")[0].rsplit(":", 1)[1]) for e in rep.errors] == [2, 3, 4, 6]


# ----------------------------------------------------------------------- dataset / collate


def test_dataset_and_collate() -> None:
    recs, _ = gsm8k_records(gsm8k_path("test"), limit=5)
    ds = PromptDataset(recs)
    assert len(ds) == 5 and ds[2] is recs[2]
    batch = collate_prompts([ds[0], ds[3]])
    assert batch == {
        "ids": ["gsm8k-test-1", "gsm8k-test-4"],
        "messages": [recs[0].messages, recs[3].messages],
        "answers": [recs[0].answer, recs[3].answer],
    }
    batch["messages"][0][0]["content"] = "changed"  # copies: the dataset is untouched
    assert recs[0].messages[0]["content"] != "changed"
    assert not any(isinstance(v, torch.Tensor) for vs in batch.values() for v in vs)


def test_dataloader_with_sampler() -> None:
    recs = [
        PromptRecord(f"r{i}", [{"role": "user", "content": str(i)}], str(i), "t") for i in range(7)
    ]
    sampler = PromptSampler(PromptDataset(recs), seed=3)
    dl = DataLoader(PromptDataset(recs), batch_size=3, sampler=sampler, collate_fn=collate_prompts)
    ids = [i for b in dl for i in b["ids"]]
    assert ids == [f"r{i}" for i in sampler.order(0)]
    assert sampler.state_dict()["epoch"] == 1 and sampler.state_dict()["position"] == 0
    ids1 = [i for b in dl for i in b["ids"]]
    assert ids1 == [f"r{i}" for i in sampler.order(1)] and ids1 != ids


# ------------------------------------------------------------------------------------ sampler


def _stream(sampler: PromptSampler):
    """The sampler's indices across epochs, as successive DataLoader epochs would draw them."""
    while True:
        yield from iter(sampler)


def test_sampler_order_is_seeded_permutation() -> None:
    s = PromptSampler(10, seed=5)
    assert len(s) == 10
    for epoch in range(3):
        g = torch.Generator().manual_seed(5 + epoch)
        assert s.order(epoch) == torch.randperm(10, generator=g).tolist()
        assert sorted(s.order(epoch)) == list(range(10))
    assert s.order(0) != s.order(1)
    assert PromptSampler(10, seed=6).order(0) != s.order(0)
    assert list(PromptSampler(4, shuffle=False)) == [0, 1, 2, 3]
    assert list(s) == s.order(0) and list(s) == s.order(1)


def test_sampler_resume_mid_epoch_across_boundary() -> None:
    n, seed = 8, 11
    uninterrupted = list(itertools.islice(_stream(PromptSampler(n, seed=seed)), 2 * n))
    ref = PromptSampler(n, seed=seed)
    assert uninterrupted == ref.order(0) + ref.order(1)
    first = PromptSampler(n, seed=seed)
    it = iter(first)
    head = [next(it) for _ in range(5)]
    state = first.state_dict()
    assert state == {"epoch": 0, "position": 5, "num_samples": n, "seed": seed, "shuffle": True}
    fresh = PromptSampler(n, seed=seed)
    fresh.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    fresh.set_epoch(0)  # what a Lightning loop does on resume: must not rewind
    tail = list(iter(fresh)) + list(iter(fresh))
    assert head + tail == uninterrupted[: 5 + len(tail)] and len(head + tail) == 2 * n


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 25),
    seed=st.integers(0, 2**31),
    stops=st.lists(st.integers(0, 30), min_size=1, max_size=4),
    start_epoch=st.integers(0, 3),
)
def test_sampler_resume_equivalence(n: int, seed: int, stops: list[int], start_epoch: int) -> None:
    total = sum(stops) + 2 * n + 1
    reference = list(
        itertools.islice(_stream(PromptSampler(n, seed=seed, epoch=start_epoch)), total)
    )
    got: list[int] = []
    state = None
    for k in [*stops, total - sum(stops)]:
        s = PromptSampler(n, seed=seed, epoch=start_epoch)
        if state is not None:
            s.load_state_dict(state)
        got += list(itertools.islice(_stream(s), k))
        state = s.state_dict()
        assert state["epoch"] == start_epoch + len(got) // n
        assert state["position"] == len(got) % n
    assert got == reference


def test_sampler_set_epoch_and_validation() -> None:
    s = PromptSampler(6, seed=1)
    it = iter(s)
    next(it), next(it)
    s.set_epoch(0)
    assert s.position == 2  # same epoch: keeps the position
    s.set_epoch(4)
    assert (s.epoch, s.position) == (4, 0)
    assert list(s) == s.order(4) and s.epoch == 5
    with pytest.raises(ValueError, match="seed=1"):
        PromptSampler(6, seed=2).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="num_samples"):
        PromptSampler(7, seed=1).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="invalid sampler state"):
        PromptSampler(6, seed=1).load_state_dict({"epoch": 0, "position": 9})
    with pytest.raises(ValueError, match="at least one"):
        PromptSampler([])
    loaded = PromptSampler(6, seed=1)
    loaded.load_state_dict({"epoch": 2, "position": 6})  # a finished epoch = next epoch's start
    assert loaded.state_dict()["epoch"] == 3 and list(loaded) == loaded.order(3)


# ----------------------------------------------------------------------- long-prompt filtering


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _records(lengths: list[int]) -> list[PromptRecord]:
    return [
        PromptRecord(f"p{i}", [{"role": "user", "content": "apples " * k}], None, "t")
        for i, k in enumerate(lengths)
    ]


def test_filter_long_prompts(tok) -> None:
    recs = _records([1, 40, 3, 80, 2])
    lens = [len(render_prompt_ids(tok, r.messages)) for r in recs]
    limit = sorted(lens)[2]  # keeps exactly the three shortest
    assert sum(n <= limit for n in lens) == 3
    kept, n_skipped = filter_long_prompts(recs, tok, limit)
    assert [r.id for r in kept] == ["p0", "p2", "p4"] and n_skipped == 2
    kept, n_skipped = filter_long_prompts(recs, tok, max(lens))
    assert kept == recs and n_skipped == 0
    kept, n_skipped = filter_long_prompts(recs, tok, limit, mode="truncate")
    assert kept == recs and n_skipped == 0
    with pytest.raises(ValueError, match=r"2 of 5 prompts exceed max_prompt_length .*'p1'"):
        filter_long_prompts(recs, tok, limit, mode="error")
    filter_long_prompts(recs[:1], tok, limit, mode="error")  # nothing too long: no error
    with pytest.raises(ValueError, match="mode"):
        filter_long_prompts(recs, tok, limit, mode="left")
    with pytest.raises(ValueError, match="max_prompt_length"):
        filter_long_prompts(recs, tok, 0)


def test_filter_counts_chat_template_tokens(tok) -> None:
    # the limit applies to the rendered template (+ generation prompt), not the raw question
    recs, _ = gsm8k_records(gsm8k_path("test"), limit=20)
    content = [len(tok(r.messages[-1]["content"])["input_ids"]) for r in recs]
    rendered = [len(render_prompt_ids(tok, r.messages, add_generation_prompt=True)) for r in recs]
    assert all(r > c for r, c in zip(rendered, content, strict=True))
    kept, _ = filter_long_prompts(recs, tok, max(content))  # raw lengths fit, rendered ones don't
    assert len(kept) < 20
    kept, n_skipped = filter_long_prompts(recs, tok, max(rendered) - 1)
    assert n_skipped == rendered.count(max(rendered)) and len(kept) == 20 - n_skipped
    kept, n_skipped = filter_long_prompts(recs, tok, max(rendered))
    assert n_skipped == 0 and len(kept) == 20
