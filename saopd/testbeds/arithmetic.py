"""The arithmetic testbed's ground truth: which response tokens a planted habit wrote.

The task, its habits and the two models come from the DVC stages of
:mod:`saopd.stages.testbed` (``task.json`` lists the habits). A habit is a phrase the teacher
writes with a fixed probability whatever the input, at a fixed place (before the solution or
after the answer line), so every response token has a known **source**:

- ``habit``: inside a planted habit phrase the response wrote (its newline included);
- ``slot``: a habit's decision position where the response did *not* write it: its first token
  when no ``start`` habit begins the response, and the token right after the answer line
  (``...\\boxed{n}.``) when no ``end`` habit follows. The teacher puts its habit rate on the habit
  there whatever the input, so the divergence at these positions is input-agnostic too;
- ``grounded``: every other token: the worked solution and the answer, which depend on the input.

:func:`token_sources` classes one response from its per-token texts (what saopd's token records
keep: :class:`saopd.lightning.callbacks.TokenViewCallback` writes them every
``trainer.view_every_n_steps`` steps); :func:`selection_by_source` counts, over the records of a
run, how many valid and filtered tokens each source has, with their mean |A_full| and grounding
gap. Pure Python (json, gzip): the records are read here directly.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from saopd.eval.habits import Habit, habits_from_task

__all__ = [
    "SOURCES",
    "SourceCounts",
    "load_habits",
    "read_token_records",
    "selection_by_source",
    "token_sources",
]

#: The ground-truth sources of a response token, in table order.
SOURCES = ("habit", "slot", "grounded")
_ANSWER_END = re.compile(r"\\boxed\{[^{}]*\}\.")


def load_habits(task_json: str | Path) -> list[Habit]:
    """The habits of a testbed's ``task.json`` (written by ``dvc repro testbed_data``)."""
    return habits_from_task(json.loads(Path(task_json).read_text(encoding="utf-8")))


def token_sources(tokens: Sequence[str], habits: Sequence[Habit]) -> list[str]:
    """The source (:data:`SOURCES`) of each token of one response, from the tokens' texts.

    A token overlapping a habit phrase's characters is ``habit``; the decision slots of habits
    that were not written are ``slot`` (module docstring); the rest is ``grounded``.
    """
    text = "".join(tokens)
    starts, pos = [], 0
    for t in tokens:
        starts.append(pos)
        pos += len(t)
    in_habit = [False] * len(text)
    for habit in habits:
        at = text.find(habit.written)
        while at >= 0:
            for i in range(at, at + len(habit.written)):
                in_habit[i] = True
            at = text.find(habit.written, at + 1)
    out = []
    for i, t in enumerate(tokens):
        span = range(starts[i], starts[i] + len(t))
        out.append("habit" if any(in_habit[j] for j in span) else "grounded")
    if not tokens:
        return out
    start_habits = [h for h in habits if h.place == "start"]
    if start_habits and out[0] != "habit":
        out[0] = "slot"
    end_habits = [h for h in habits if h.place == "end"]
    matches = list(_ANSWER_END.finditer(text))
    match = matches[-1] if matches else None
    if end_habits and match is not None:
        end = match.end()
        nxt = next((i for i, s in enumerate(starts) if s >= end), None)
        if nxt is not None and out[nxt] != "habit":
            out[nxt] = "slot"
    return out


def read_token_records(folder: str | Path) -> list[dict[str, Any]]:
    """Every step record under ``folder`` (``step_*.jsonl[.gz]``, saopd's token records), in step
    order: ``{"step": int, "responses": [{"tokens", "a_full", "a_res", "filtered"}, ...]}``."""
    records = []
    for path in sorted(Path(folder).glob("step_*.jsonl*")):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as fh:
            lines = [json.loads(line) for line in fh if line.strip()]
        header = next(x for x in lines if x.get("kind") == "header")
        records.append({"step": int(header["step"]), "stats": header.get("stats", {}),
                        "responses": [x for x in lines if x.get("kind") == "response"]})
    return sorted(records, key=lambda r: r["step"])


@dataclass
class SourceCounts:
    """Valid and filtered tokens per source, with sums of |A_full| and of the grounding gap
    |A_full - A_res| (where A_res was computed)."""

    valid: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    filtered: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    abs_a: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0.0))
    gap: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0.0))
    gap_n: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))

    def add(self, other: SourceCounts) -> None:
        """Add ``other``'s counts to these."""
        for attr in ("valid", "filtered", "abs_a", "gap", "gap_n"):
            mine, theirs = getattr(self, attr), getattr(other, attr)
            for s in SOURCES:
                mine[s] += theirs[s]

    def summary(self) -> dict[str, float]:
        """``filtered_share`` (filtered / valid), per source ``p_filtered_<s>`` (share of its
        tokens filtered), ``share_<s>`` (of all valid tokens), ``filtered_from_<s>`` (share of
        the filtered tokens), ``abs_a_<s>`` and ``gap_<s>`` (means); NaN where undefined."""
        nan = float("nan")
        total_v, total_f = sum(self.valid.values()), sum(self.filtered.values())
        out = {"tokens": float(total_v), "filtered_share": total_f / total_v if total_v else nan}
        for s in SOURCES:
            v, f = self.valid[s], self.filtered[s]
            out[f"share_{s}"] = v / total_v if total_v else nan
            out[f"p_filtered_{s}"] = f / v if v else nan
            out[f"filtered_from_{s}"] = f / total_f if total_f else nan
            out[f"abs_a_{s}"] = self.abs_a[s] / v if v else nan
            out[f"gap_{s}"] = self.gap[s] / self.gap_n[s] if self.gap_n[s] else nan
        return out


def selection_by_source(responses: Iterable[Mapping[str, Any]], habits: Sequence[Habit]
                        ) -> SourceCounts:
    """Counts by source over token-record responses (``tokens``, ``a_full``, ``a_res``,
    ``filtered``)."""
    counts = SourceCounts()
    for r in responses:
        sources = token_sources(r["tokens"], habits)
        a_res = r.get("a_res")
        for i, s in enumerate(sources):
            counts.valid[s] += 1
            counts.filtered[s] += int(bool(r["filtered"][i]))
            counts.abs_a[s] += abs(float(r["a_full"][i]))
            if a_res is not None and a_res[i] is not None:
                counts.gap[s] += abs(float(r["a_full"][i]) - float(a_res[i]))
                counts.gap_n[s] += 1
    return counts
