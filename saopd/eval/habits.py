"""Planted habit phrases: what the arithmetic testbed's teacher writes with a fixed probability
whatever the input (:mod:`saopd.stages.testbed`), what its held-out benchmark counts in the
student's samples (:func:`saopd.eval.grading.grade_exact_phrases`) and what its ground truth
marks in a response's tokens (:mod:`saopd.testbeds.arithmetic`), and the shortcut, its harmful
input-agnostic prior (:func:`follows_shortcut`). One definition for all three.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["HABIT_PLACES", "Habit", "follows_shortcut", "habits_from_task"]

#: Where a habit phrase goes: before the solution, or after the answer line.
HABIT_PLACES = ("start", "end")


@dataclass(frozen=True)
class Habit:
    """A planted phrase written with a fixed probability whatever the input.

    Attributes:
        name: the habit's name (metric ``eval/arith/phrase_<name>``).
        text: the phrase exactly as written (``start``: followed by a newline; ``end``: preceded
            by one).
        place: ``start`` or ``end`` (:data:`HABIT_PLACES`).
    """

    name: str
    text: str
    place: str

    @property
    def written(self) -> str:
        """The phrase as it appears in a response, with its newline."""
        return self.text + "\n" if self.place == "start" else "\n" + self.text


def habits_from_task(spec: Mapping[str, Any]) -> list[Habit]:
    """The habits a testbed's ``task.json`` (``dvc repro testbed_data``) lists."""
    return [Habit(h["name"], h["text"], h["place"]) for h in spec["habits"]]


def follows_shortcut(text: str, answer_prefix: str) -> bool:
    """Whether a response took the **shortcut**: it writes ``answer_prefix`` (the answer line's
    opening words, e.g. ``"So the answer is"``) before any digit, i.e. gives the answer without
    a worked line. A response without ``answer_prefix`` did not take it.

    The arithmetic testbed's harmful prior (:mod:`saopd.stages.testbed`): the teacher answers
    this way at a fixed rate whatever the input; a student too weak to add without the worked
    lines gets most such answers wrong.
    """
    at = text.find(answer_prefix)
    return at >= 0 and not any(c.isdigit() for c in text[:at])
