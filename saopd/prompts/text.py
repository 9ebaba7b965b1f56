"""Prompt data for on-policy training: JSONL, GSM8K records, a dataset and a resumable sampler.

Training only needs prompts (chat ``messages`` ending with the user turn) and, for evaluation or
reward-style metrics, a gold ``answer``; responses are sampled on-policy by the student.

- :func:`load_jsonl` reads one JSON object per line; a bad line raises ``ValueError`` naming
  ``file:line`` (1-based), or is skipped and counted in the :class:`ReadReport` with
  ``skip_bad=True``. Blank lines are ignored (they still count for line numbers).
- :func:`gsm8k_records` turns GSM8K rows into :class:`PromptRecord` s. The user turn is the
  question followed by :data:`GSM8K_INSTRUCTION` (the suffix verl's GSM8K preprocessing appends,
  ``Let's think step by step and output the final answer after "####".``), so that generations
  end with GSM8K's own ``#### <number>`` answer format; the gold answer is the number after the
  last ``####`` of the reference solution, commas removed.
- :class:`PromptDataset` + :func:`collate_prompts` give plain Python batches (no tensors:
  tokenization happens in the rollout/context code with the chat template).
- :class:`PromptSampler` shuffles with ``torch.Generator().manual_seed(seed + epoch)`` and keeps
  ``(epoch, position)`` so a run resumes at the exact next prompt, also mid-epoch.
- :func:`filter_long_prompts` drops (or rejects) prompts whose chat-template rendering is longer
  than ``max_prompt_length`` tokens; a rendering too long in characters to fit
  (:func:`prompt_char_limit`) is counted as too long without being tokenized;
  :func:`cut_prompt_texts` cuts such a prompt's text from its start for ``truncate`` mode, so
  that the engine's left truncation never tokenizes megabytes.

The vendored GSM8K files live in ``data/gsm8k`` (see its ``PROVENANCE.md``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset, Sampler

from saopd.choices import LONG_PROMPT_MODES
from saopd.config.data import GSM8K_INSTRUCTION
from saopd.io import PathLike, iter_jsonl_objects
from saopd.prompts.render import longest_token_chars, render_prompt_text, rendered_ids
from saopd.validation import check_choice

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "GSM8K_DIR",
    "PromptDataset",
    "PromptRecord",
    "PromptSampler",
    "ReadReport",
    "collate_prompts",
    "cut_prompt_texts",
    "filter_long_prompts",
    "gsm8k_answer",
    "gsm8k_path",
    "gsm8k_records",
    "gsm8k_user_content",
    "load_jsonl",
    "message_chars",
    "prompt_char_limit",
]

logger = logging.getLogger(__name__)



#: Suffix appended (after one space) to every GSM8K question; verl's ``gsm8k.py`` preprocessing
#: uses the same wording. It asks for GSM8K's native ``#### <answer>`` format.

#: ``data/gsm8k`` of the repository checkout (vendored train/test JSONL, see its PROVENANCE.md).
GSM8K_DIR = Path(__file__).resolve().parents[2] / "data" / "gsm8k"



# --------------------------------------------------------------------------------------- JSONL


@dataclass
class ReadReport:
    """What a JSONL read kept and dropped.

    ``rows``: records returned; ``skipped``: bad lines (or bad rows) dropped with ``skip_bad``;
    ``errors``: one ``"file:line: reason"`` message per skipped line.
    """

    path: str
    rows: int = 0
    skipped: int = 0
    errors: list[str] = field(default_factory=list)

    def bad(self, msg: str, skip_bad: bool) -> None:
        """Raise ``ValueError(msg)``, or with ``skip_bad`` count and record ``msg``."""
        if not skip_bad:
            raise ValueError(msg)
        self.skipped += 1
        self.errors.append(msg)


def _iter_jsonl(
    path: PathLike, report: ReadReport, skip_bad: bool
) -> Iterator[tuple[int, dict[str, Any]]]:
    """:func:`iter_jsonl_objects` with bad lines raised or counted in ``report``."""
    return iter_jsonl_objects(path, lambda msg: report.bad(msg, skip_bad))


def load_jsonl(
    path: PathLike, *, skip_bad: bool = False
) -> tuple[list[dict[str, Any]], ReadReport]:
    """Read a JSON-lines file of objects.

    Returns the objects and a :class:`ReadReport`. A line that is not valid UTF-8 or JSON, or not
    a JSON object, raises ``ValueError("<file>:<line>: ...")`` (1-based line number); with
    ``skip_bad=True`` it is skipped and recorded in the report instead. Blank lines are ignored.
    """
    report = ReadReport(path=os.fspath(path))
    rows = [obj for _, obj in _iter_jsonl(path, report, skip_bad)]
    report.rows = len(rows)
    return rows, report


# ------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class PromptRecord:
    """One training/evaluation prompt.

    ``messages``: chat messages ending with the user turn (no assistant turn; the rollout adds the
    generation prompt). ``answer``: gold final answer as a string (GSM8K: the number after
    ``####``), ``None`` when the source has none. ``source``: dataset name (e.g. ``"gsm8k"``).
    """

    id: str
    messages: list[dict[str, Any]]
    answer: str | None
    source: str


def gsm8k_answer(solution: str) -> str:
    """Gold answer of a GSM8K reference solution: the text after the last ``####``, stripped, with
    thousands separators removed (``"... #### 1,000"`` -> ``"1000"``).

    Raises ``ValueError`` if there is no ``####`` or nothing after it.
    """
    if "####" not in solution:
        raise ValueError("the answer has no '####' marker")
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not answer:
        raise ValueError("the answer is empty after '####'")
    return answer


def gsm8k_user_content(question: str, instruction: str | None = GSM8K_INSTRUCTION) -> str:
    """The user turn for a GSM8K question: ``question + " " + instruction`` (question alone when
    ``instruction`` is empty or ``None``)."""
    question = question.strip()
    return f"{question} {instruction}" if instruction else question


def gsm8k_path(split: str = "train") -> Path:
    """Path of the vendored ``data/gsm8k/<split>.jsonl`` (``split``: ``"train"`` or ``"test"``)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    path = GSM8K_DIR / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: the vendored GSM8K files are in data/gsm8k of the repository "
            "checkout (pass an explicit path when running from an installed package)"
        )
    return path


def gsm8k_records(
    path: PathLike,
    *,
    system_prompt: str | None = None,
    instruction: str | None = GSM8K_INSTRUCTION,
    limit: int | None = None,
    skip_bad: bool = False,
    split: str | None = None,
) -> tuple[list[PromptRecord], ReadReport]:
    """Build :class:`PromptRecord` s from a GSM8K JSONL file (``{"question", "answer"}`` rows).

    - messages: ``[{"role": "system", "content": system_prompt}]`` if given, then the user turn
      :func:`gsm8k_user_content` (question + ``" "`` + ``instruction``; ``instruction=None`` or
      ``""`` gives the bare question);
    - answer: :func:`gsm8k_answer` of the row's ``answer`` (e.g. ``"72"``);
    - id: ``f"gsm8k-{split}-{line}"`` with the 1-based line number in the file, ``split``
      defaulting to the file stem (``train``/``test``); source ``"gsm8k"``.

    A bad line (see :func:`load_jsonl`), or a row whose ``question``/``answer`` is missing, not a
    non-empty string, or has no ``####`` answer raises ``ValueError`` naming ``file:line``; with
    ``skip_bad=True`` it is skipped and counted in the returned :class:`ReadReport`. ``limit``
    keeps the first ``limit`` good records and stops reading there (later lines are not checked).
    """
    if limit is not None and (isinstance(limit, bool) or limit < 0):
        raise ValueError(f"limit must be an int >= 0 or None, got {limit!r}")
    split = split if split is not None else Path(path).stem
    name = os.fspath(path)
    report = ReadReport(path=name)
    records: list[PromptRecord] = []
    if limit == 0:
        return records, report
    for lineno, row in _iter_jsonl(path, report, skip_bad):
        where = f"{name}:{lineno}"
        bad = [
            k
            for k in ("question", "answer")
            if not isinstance(row.get(k), str) or not row[k].strip()
        ]
        if bad:
            report.bad(
                f"{where}: missing or empty field(s) {bad} (need non-empty strings 'question' "
                f"and 'answer'; keys: {sorted(row)})",
                skip_bad,
            )
            continue
        try:
            answer = gsm8k_answer(row["answer"])
        except ValueError as e:
            report.bad(f"{where}: {e}", skip_bad)
            continue
        messages: list[dict[str, Any]] = []
        if system_prompt:
            messages.append({"role": "system", "content": system_prompt})
        messages.append(
            {"role": "user", "content": gsm8k_user_content(row["question"], instruction)}
        )
        records.append(
            PromptRecord(
                id=f"gsm8k-{split}-{lineno}", messages=messages, answer=answer, source="gsm8k"
            )
        )
        if limit is not None and len(records) >= limit:
            break
    report.rows = len(records)
    return records, report


# ------------------------------------------------------------------------------ dataset/loader


class PromptDataset(Dataset):
    """A map-style dataset over :class:`PromptRecord` s (item ``i`` is ``records[i]``)."""

    def __init__(self, records: Sequence[PromptRecord]) -> None:
        self.records = list(records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> PromptRecord:
        return self.records[index]


def collate_prompts(batch: Sequence[PromptRecord]) -> dict[str, list[Any]]:
    """Collate records into ``{"ids": [str], "messages": [[dict]], "answers": [str | None]}``.

    Plain lists, no tensors; the messages are copies, so callers may modify them freely.
    """
    return {
        "ids": [r.id for r in batch],
        "messages": [[dict(m) for m in r.messages] for r in batch],
        "answers": [r.answer for r in batch],
    }


class PromptSampler(Sampler[int]):
    """Deterministic, resumable order over ``num_samples`` prompts.

    Epoch ``e`` visits ``torch.randperm(n, generator=torch.Generator().manual_seed(seed + e))``
    (``0..n-1`` with ``shuffle=False``). One ``iter()`` yields the rest of the current epoch from
    the current position; exhausting it moves to the next epoch, so successive ``iter()`` calls
    (one per DataLoader epoch) walk epochs ``e, e+1, ...``.

    :meth:`state_dict` holds ``epoch`` and ``position`` (indices already yielded in that epoch);
    a fresh sampler with the same ``num_samples``/``seed``/``shuffle`` that loads it continues
    with exactly the next index, also mid-epoch. :meth:`set_epoch` (called by Lightning/DDP-style
    loops at each epoch start) moves to another epoch's start, but is a no-op for the current
    epoch, so it does not undo a mid-epoch resume.

    The position counts indices handed out. A ``DataLoader`` with workers prefetches batches, so
    the sampler runs ahead of the batches actually trained on; for exact resumption save
    ``{"epoch": ..., "position": <prompts consumed this epoch>}`` from the training loop's own
    count (or iterate with ``num_workers=0``). ``len()`` is the full epoch length ``n``.
    """

    def __init__(
        self, data_source: Sized | int, *, seed: int = 0, shuffle: bool = True, epoch: int = 0
    ) -> None:
        n = data_source if isinstance(data_source, int) else len(data_source)
        if isinstance(n, bool) or n < 1:
            raise ValueError(f"PromptSampler needs at least one sample, got {n!r}")
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.num_samples = int(n)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self._epoch = int(epoch)
        self._position = 0

    @property
    def epoch(self) -> int:
        """The epoch the next index comes from."""
        self._roll_over()
        return self._epoch

    @property
    def position(self) -> int:
        """Indices already yielded in :attr:`epoch`."""
        self._roll_over()
        return self._position

    def _roll_over(self) -> None:
        if self._position >= self.num_samples:
            self._epoch += 1
            self._position = 0

    def order(self, epoch: int) -> list[int]:
        """The full index order of ``epoch``."""
        if not self.shuffle:
            return list(range(self.num_samples))
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        self._roll_over()
        epoch = self._epoch
        order = self.order(epoch)
        for i in range(self._position, self.num_samples):
            if self._epoch != epoch:  # set_epoch/load_state_dict during iteration
                return
            self._position = i + 1
            yield order[i]
        self._roll_over()

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning, unless it is already the current epoch."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self._roll_over()
        if epoch != self._epoch:
            self._epoch = int(epoch)
            self._position = 0

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "position", "num_samples", "seed", "shuffle"}`` (a finished epoch is stored
        as the next epoch at position 0)."""
        self._roll_over()
        return {
            "epoch": self._epoch,
            "position": self._position,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`. Raises ``ValueError`` if ``num_samples``, ``seed`` or
        ``shuffle`` differ (the order would not be the saved one) or the position is out of range.
        """
        for key in ("num_samples", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this sampler has "
                    f"{key}={getattr(self, key)!r}; the resumed order would differ"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.num_samples:
            raise ValueError(
                f"invalid sampler state epoch={epoch}, position={position} "
                f"(num_samples {self.num_samples})"
            )
        self._epoch, self._position = epoch, position
        self._roll_over()


# ------------------------------------------------------------------------------------- length


#: Margin of :func:`prompt_char_limit` over the longest token: normalisers that merge characters
#: (Unicode composition) make a token cover a few more characters of the raw text.
CHAR_LIMIT_MARGIN = 4


def prompt_char_limit(tokenizer: PreTrainedTokenizerBase, max_prompt_length: int) -> int:
    """Characters above which a rendered prompt cannot fit ``max_prompt_length`` tokens:
    ``CHAR_LIMIT_MARGIN`` x the longest vocabulary entry's characters
    (:func:`~saopd.prompts.render.longest_token_chars`) x ``max_prompt_length``. Tokenizing a
    text costs time in proportion to its length (minutes for a line of tens of megabytes), so
    such a prompt is counted as too long without being tokenized."""
    return CHAR_LIMIT_MARGIN * longest_token_chars(tokenizer) * max_prompt_length


def message_chars(messages: Sequence[Mapping[str, Any]]) -> int:
    """Characters of text in chat ``messages``: string contents plus the ``text`` of content
    parts (images and other non-text parts count 0)."""
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part.get("text") or "") for part in content
                         if isinstance(part, Mapping) and part.get("type") == "text")
    return total


def _cut_text_start(messages: Sequence[Mapping[str, Any]], max_chars: int
                    ) -> list[dict[str, Any]]:
    """``messages`` with the start of their text cut so that at most ``max_chars`` characters of
    text remain: the last characters are kept, walking back from the last message (as left
    truncation keeps the last tokens); earlier text is emptied. Non-text parts are kept."""
    budget = max_chars
    out: list[dict[str, Any]] = []
    for message in reversed(messages):
        new = dict(message)
        content = message.get("content")
        if isinstance(content, str):
            new["content"] = content[len(content) - budget:] if budget > 0 else ""
            budget = max(0, budget - len(content))
        elif isinstance(content, list):
            parts: list[Any] = []
            for part in reversed(content):
                if isinstance(part, Mapping) and part.get("type") == "text":
                    text = part.get("text") or ""
                    part = {**part, "text": text[len(text) - budget:] if budget > 0 else ""}
                    budget = max(0, budget - len(text))
                parts.append(part)
            new["content"] = parts[::-1]
        out.append(new)
    return out[::-1]


def cut_prompt_texts(
    records: Sequence[PromptRecord], tokenizer: PreTrainedTokenizerBase, max_prompt_length: int,
) -> tuple[list[PromptRecord], int]:
    """For ``data.long_prompts=truncate``: cut the start of the text of each prompt whose text is
    longer than :func:`prompt_char_limit` characters, keeping its last ``prompt_char_limit``
    characters, before anything tokenizes it.

    The engine then left-truncates the rendered prompt to its last ``max_prompt_length`` tokens
    as before: the kept tail is at least ``CHAR_LIMIT_MARGIN x max_prompt_length`` tokens long,
    so those last tokens come from text the cut did not touch (the same ids as without the
    cut), and a prompt of tens of megabytes no longer costs minutes of tokenizing each time it
    is sampled. Returns ``(records, n_cut)``; records not over the bound are returned as they
    are.
    """
    limit = prompt_char_limit(tokenizer, max_prompt_length)
    out: list[PromptRecord] = []
    n_cut = 0
    for rec in records:
        if message_chars(rec.messages) > limit:
            rec = replace(rec, messages=_cut_text_start(rec.messages, limit))
            n_cut += 1
        out.append(rec)
    if n_cut:
        logger.warning("%d of %d prompts are over %s characters, more than max_prompt_length %d "
                       "tokens can hold: the start of their text was cut before tokenizing "
                       "(data.long_prompts=truncate)", n_cut, len(records), f"{limit:,}",
                       max_prompt_length)
    return out, n_cut


def filter_long_prompts(
    records: Sequence[PromptRecord],
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_length: int,
    mode: str = "skip",
    *,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[PromptRecord], int]:
    """Drop prompts longer than ``max_prompt_length`` tokens.

    The length is that of the prompt as the rollout feeds it: the chat template rendered with the
    generation prompt (:func:`saopd.prompts.render.render_prompt_ids`, ``chat_template_kwargs``
    passed through). ``mode``: ``"skip"`` drops over-long records, ``"error"`` raises
    ``ValueError`` naming the first over-long record and the count, ``"truncate"`` keeps them all
    (the engine and the contexts cut them later; a warning gives the count). Returns
    ``(records, n_skipped)``; ``n_skipped`` is 0 unless ``mode="skip"``. In ``skip`` and
    ``error`` modes a rendering longer than :func:`prompt_char_limit` characters is too long
    without being tokenized (and counted with the others).
    """
    check_choice("mode", mode, LONG_PROMPT_MODES)
    if (
        isinstance(max_prompt_length, bool)
        or not isinstance(max_prompt_length, int)
        or (max_prompt_length < 1)
    ):
        raise ValueError(f"max_prompt_length must be an int >= 1, got {max_prompt_length!r}")
    kept: list[PromptRecord] = []
    too_long: list[tuple[str, str]] = []  # (id, its length as told)
    char_limit = prompt_char_limit(tokenizer, max_prompt_length) if mode != "truncate" else None
    for rec in records:
        text = render_prompt_text(tokenizer, rec.messages, add_generation_prompt=True,
                                  chat_template_kwargs=chat_template_kwargs)
        if char_limit is not None and len(text) > char_limit:
            too_long.append((rec.id, f"{len(text):,} characters, not tokenized"))
            if mode == "skip":
                continue
        else:
            n = len(rendered_ids(tokenizer, text))
            if n > max_prompt_length:
                too_long.append((rec.id, str(n)))
                if mode == "skip":
                    continue
        kept.append(rec)
    if too_long:
        first_id, first_n = too_long[0]
        msg = (
            f"{len(too_long)} of {len(records)} prompts exceed max_prompt_length "
            f"{max_prompt_length} tokens (first: {first_id!r} with {first_n})"
        )
        if mode == "error":
            raise ValueError(msg)
        logger.warning("%s; %s", msg, "skipped" if mode == "skip" else "kept")
    return kept, len(too_long) if mode == "skip" else 0
