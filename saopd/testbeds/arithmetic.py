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
- ``shortcut``: the decision token of the harmful prior where the response took it: the first
  token of an answer line written before any digit (:func:`saopd.eval.habits.follows_shortcut`;
  ``task.json``'s ``shortcut.answer_prefix``). The prior teacher puts its shortcut rate there
  whatever the input, so this token's divergence is input-agnostic; the answer that follows is
  ``grounded``;
- ``tic`` and ``tic_slot`` (the tic testbed, :mod:`saopd.testbeds.tic`): the tokens of a written
  tic (whole or begun; its EOS included), and the other positions where the tic prior is in play
  (the slot after the first answer line when the response did not write the tic, e.g. its EOS;
  the token where a begun tic was left), as :func:`saopd.filters.oracle.tic_positions` finds
  them in the recorded ids (:class:`TicTruth`); the slot oracle removes both, the tic oracle the
  first;
- ``grounded``: every other token: the worked solution and the answer, which depend on the input.

:func:`token_sources` classes one response from its per-token texts (what saopd's token records
keep: :class:`saopd.lightning.callbacks.TokenViewCallback` writes them every
``trainer.view_every_n_steps`` steps); :func:`selection_by_source` counts, over the records of a
run, how many valid and filtered tokens each source has, with their mean |A_full| and grounding
gap; :func:`selection_at_ratios` re-applies SA-OPD's rule to the recorded signals at other
(p1, p2). The records are read with json and gzip; only the counterfactual imports torch.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from saopd.eval.habits import Habit, follows_shortcut, habits_from_task

__all__ = [
    "SOURCES",
    "SourceCounts",
    "TicTruth",
    "load_habits",
    "load_shortcut",
    "load_tic",
    "read_token_records",
    "selection_at_ratios",
    "selection_by_source",
    "token_sources",
]

#: The ground-truth sources of a response token, in table order.
SOURCES = ("habit", "slot", "shortcut", "tic", "tic_slot", "grounded")


@dataclass(frozen=True)
class TicTruth:
    """The tic testbed's ground truth in token ids: the answer line's last token and the tic's
    ids, EOS last (:func:`saopd.filters.oracle.tic_token_ids`)."""

    answer_end_id: int
    tic_ids: tuple[int, ...]

    def sources(self, response_ids: Sequence[int]) -> list[str | None]:
        """``tic`` / ``tic_slot`` at the positions where the prior is in play, None elsewhere."""
        import torch

        from saopd.filters.oracle import tic_positions

        if not response_ids:
            return []
        ids = torch.tensor([list(response_ids)], dtype=torch.long)
        pos = tic_positions(ids, torch.ones_like(ids, dtype=torch.bool), self.answer_end_id,
                            self.tic_ids)
        return ["tic" if t else "tic_slot" if a else None
                for a, t in zip(pos.active[0].tolist(), pos.tic[0].tolist(), strict=True)]
_ANSWER_END = re.compile(r"\\boxed\{[^{}]*\}\.")


def load_habits(task_json: str | Path) -> list[Habit]:
    """The habits of a testbed's ``task.json`` (written by ``dvc repro testbed_data``)."""
    return habits_from_task(json.loads(Path(task_json).read_text(encoding="utf-8")))


def load_shortcut(task_json: str | Path) -> str | None:
    """The shortcut's answer prefix of a testbed's ``task.json`` (None for a task without one)."""
    spec = json.loads(Path(task_json).read_text(encoding="utf-8"))
    shortcut = spec.get("shortcut")
    return None if shortcut is None else str(shortcut["answer_prefix"])


def load_tic(task_json: str | Path) -> str | None:
    """The tic's text of a testbed's ``task.json`` (None for a task without one)."""
    spec = json.loads(Path(task_json).read_text(encoding="utf-8"))
    tic = spec.get("tic")
    return None if tic is None else str(tic["text"])


def token_sources(tokens: Sequence[str], habits: Sequence[Habit],
                  shortcut: str | None = None, tic: TicTruth | None = None,
                  response_ids: Sequence[int] | None = None) -> list[str]:
    """The source (:data:`SOURCES`) of each token of one response, from the tokens' texts.

    A token overlapping a habit phrase's characters is ``habit``; the decision slots of habits
    that were not written are ``slot``; with ``shortcut`` (the answer prefix), the first token of
    a shortcut answer line is ``shortcut`` (module docstring); with ``tic`` (and the response's
    ``response_ids``), the positions where the tic prior is in play are ``tic`` / ``tic_slot``
    (:class:`TicTruth`); the rest is ``grounded``.
    """
    out = _text_sources(tokens, habits, shortcut)
    if tic is not None:
        if response_ids is None or len(response_ids) != len(tokens):
            raise ValueError("the tic's sources need the response's ids, one per token")
        for i, src in enumerate(tic.sources(response_ids)):
            if src is not None:
                out[i] = src
    return out


def _text_sources(tokens: Sequence[str], habits: Sequence[Habit],
                  shortcut: str | None) -> list[str]:
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
    if shortcut is not None and follows_shortcut(text, shortcut):
        at = text.find(shortcut)
        first = next(i for i, s in enumerate(starts) if s + len(tokens[i]) > at)
        out[first] = "shortcut"
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
    #: the first token of each written habit (where the response chose to write it): valid and
    #: filtered counts, a subset of the ``habit`` source
    onset_valid: int = 0
    onset_filtered: int = 0

    def add(self, other: SourceCounts) -> None:
        """Add ``other``'s counts to these."""
        for attr in ("valid", "filtered", "abs_a", "gap", "gap_n"):
            mine, theirs = getattr(self, attr), getattr(other, attr)
            for s in SOURCES:
                mine[s] += theirs[s]
        self.onset_valid += other.onset_valid
        self.onset_filtered += other.onset_filtered

    def count(self, source: str, filtered: bool, a_full: float, a_res: float | None,
              onset: bool = False) -> None:
        """Add one valid token of ``source``."""
        self.valid[source] += 1
        self.filtered[source] += int(filtered)
        self.abs_a[source] += abs(a_full)
        if a_res is not None:
            self.gap[source] += abs(a_full - a_res)
            self.gap_n[source] += 1
        if onset:
            self.onset_valid += 1
            self.onset_filtered += int(filtered)

    def summary(self) -> dict[str, float]:
        """``filtered_share`` (filtered / valid), per source ``p_filtered_<s>`` (share of its
        tokens filtered), ``share_<s>`` (of all valid tokens), ``filtered_from_<s>`` (share of
        the filtered tokens), ``abs_a_<s>`` and ``gap_<s>`` (means), ``habit_onsets`` and
        ``p_filtered_habit_onset`` (the first tokens of written habits); NaN where undefined."""
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
        out["habit_onsets"] = float(self.onset_valid)
        out["p_filtered_habit_onset"] = (self.onset_filtered / self.onset_valid
                                         if self.onset_valid else nan)
        return out


def _onsets(sources: Sequence[str]) -> list[bool]:
    """True at the first token of each run of ``habit`` tokens."""
    return [s == "habit" and (i == 0 or sources[i - 1] != "habit")
            for i, s in enumerate(sources)]


def selection_by_source(responses: Iterable[Mapping[str, Any]], habits: Sequence[Habit],
                        shortcut: str | None = None, tic: TicTruth | None = None
                        ) -> SourceCounts:
    """Counts by source over token-record responses (``tokens``, ``a_full``, ``a_res``,
    ``filtered``, ``response_ids``); ``shortcut``: the answer prefix (:func:`load_shortcut`), if
    the task has one; ``tic``: the tic testbed's truth (:class:`TicTruth`)."""
    counts = SourceCounts()
    for r in responses:
        sources = token_sources(r["tokens"], habits, shortcut, tic, r.get("response_ids"))
        a_res = r.get("a_res")
        for i, (s, onset) in enumerate(zip(sources, _onsets(sources), strict=True)):
            res = None if a_res is None or a_res[i] is None else float(a_res[i])
            counts.count(s, bool(r["filtered"][i]), float(r["a_full"][i]), res, onset)
    return counts


def selection_at_ratios(records: Iterable[Mapping[str, Any]], habits: Sequence[Habit],
                        ratios: Sequence[tuple[float, float]], *, extreme: str = "abs",
                        shortcut: str | None = None, tic: TicTruth | None = None
                        ) -> dict[tuple[float, float], SourceCounts]:
    """What SA-OPD's rule would remove, by source, at other ``(p1, p2)``, on recorded steps.

    A counterfactual on a run's token records (``read_token_records``): per recorded step, the
    recorded rows' A_full and grounding gap |A_full - A_res| are stacked into ``[B, T]`` tensors
    (``valid`` = the recorded tokens) and :func:`saopd.filters.sa_opd.spurious_token_mask` (Eq.
    16, no FLMR bound) is applied at each ratio pair; the run's own training is not changed.
    Steps whose rows lack A_res (a run that never scored the residual context, e.g. vanilla OPD)
    are skipped. The records keep A values to 6 decimals, so near-ties may rank differently
    from the run's own filter.
    """
    import torch

    from saopd.filters.sa_opd import spurious_token_mask

    out = {ratio: SourceCounts() for ratio in ratios}
    for record in records:
        rows = [r for r in record["responses"]
                if r.get("a_res") is not None and None not in r["a_res"] and r["tokens"]]
        if not rows:
            continue
        width = max(len(r["tokens"]) for r in rows)
        a_full = torch.zeros(len(rows), width, dtype=torch.float64)
        a_res = torch.zeros_like(a_full)
        valid = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, r in enumerate(rows):
            n = len(r["tokens"])
            a_full[i, :n] = torch.tensor(r["a_full"], dtype=torch.float64)
            a_res[i, :n] = torch.tensor(r["a_res"], dtype=torch.float64)
            valid[i, :n] = True
        sources = [token_sources(r["tokens"], habits, shortcut, tic, r.get("response_ids"))
                   for r in rows]
        onsets = [_onsets(s) for s in sources]
        gap = (a_full - a_res).abs()
        for ratio in ratios:
            mask = spurious_token_mask(a_full, gap, valid, p1=ratio[0], p2=ratio[1],
                                       extreme=extreme).mask.tolist()
            counts = out[ratio]
            for i, r in enumerate(rows):
                for j, (s, onset) in enumerate(zip(sources[i], onsets[i], strict=True)):
                    counts.count(s, mask[i][j], float(r["a_full"][j]), float(r["a_res"][j]),
                                 onset)
    return out
