"""The prompt-source registry and load_prompts: what is read, skipped and said about it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from saopd.config.data import DataConfig
from saopd.lightning.data import PromptDataModule
from saopd.prompts.sources import PROMPT_SOURCES, load_prompts
from saopd.prompts.text import PromptRecord


def _gsm8k(path: Path, rows: list[str]) -> DataConfig:
    path.write_text("\n".join(rows) + "\n")
    return DataConfig(source="gsm8k", path=str(path), skip_bad=True)


def test_every_data_source_is_registered() -> None:
    from saopd.choices import DATA_SOURCES

    assert PROMPT_SOURCES.names() == sorted(DATA_SOURCES)


def test_skipped_rows_are_listed_with_file_line_and_reason(tmp_path: Path, tiny_tok,
                                                           caplog) -> None:
    good = json.dumps({"question": "1+1?", "answer": "so #### 2"})
    data = _gsm8k(tmp_path / "train.jsonl", [good, "{not json", json.dumps({"question": "q"})])
    with caplog.at_level(logging.WARNING, logger="saopd.prompts.sources"):
        records, counts = load_prompts(data, tiny_tok)
    assert len(records) == 1 and counts["rows_skipped_bad"] == 2
    text = caplog.text
    assert f"{tmp_path / 'train.jsonl'}:2: invalid JSON" in text
    assert f"{tmp_path / 'train.jsonl'}:3: missing or empty field(s) ['answer']" in text


def test_an_empty_file_is_not_blamed_on_the_length_limit(tmp_path: Path, tiny_tok) -> None:
    data = _gsm8k(tmp_path / "empty.jsonl", [""])
    with pytest.raises(ValueError, match=r"no training prompts left from .*empty\.jsonl \(read 0,"
                                         r" skipped 0 bad rows and 0 over"):
        load_prompts(data, tiny_tok)


def test_more_prompts_per_step_than_prompts_is_said() -> None:
    records = [PromptRecord(str(i), [{"role": "user", "content": "q"}], "1", "x")
               for i in range(3)]
    with pytest.warns(UserWarning, match=r"prompts_per_step \(4\) is larger than the 3"):
        PromptDataModule(records, prompts_per_step=4, num_steps=1)
