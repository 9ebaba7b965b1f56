"""Planted habit phrases and the shortcut (saopd.eval.habits): how a habit is written, the
habits a task file lists, and when a response took the shortcut."""

from __future__ import annotations

import pytest

from saopd.eval.habits import HABIT_PLACES, Habit, follows_shortcut, habits_from_task

PREFIX = "So the answer is"


def test_a_habit_is_written_with_its_newline_on_the_side_of_the_solution() -> None:
    assert HABIT_PLACES == ("start", "end")
    assert Habit("preamble", "Let us think.", "start").written == "Let us think.\n"
    assert Habit("signoff", "Done.", "end").written == "\nDone."


def test_habits_from_a_task_file_keep_their_order_and_fields() -> None:
    spec = {"habits": [{"name": "a", "text": "Alpha.", "place": "end"},
                       {"name": "b", "text": "Beta.", "place": "start"}]}
    assert habits_from_task(spec) == [Habit("a", "Alpha.", "end"), Habit("b", "Beta.", "start")]
    assert habits_from_task({"habits": []}) == []
    with pytest.raises(KeyError):
        habits_from_task({"habits": [{"name": "a", "text": "x"}]})  # no place


@pytest.mark.parametrize("text, took", [
    ("So the answer is \\boxed{3}.", True),                       # the answer line alone
    ("Let us think.\nSo the answer is \\boxed{3}.", True),        # a habit is not work
    ("1 + 2 = 3\nSo the answer is \\boxed{3}.", False),           # a worked line first
    ("So the answer is \\boxed{3}.\n1 + 2 = 3", True),            # digits after do not count
    ("Let us think.", False),                                     # no answer line at all
    ("", False),
    ("Step 1: so the answer is 3", False),                        # a digit before, and no prefix
])
def test_the_shortcut_is_the_answer_line_before_any_digit(text: str, took: bool) -> None:
    assert follows_shortcut(text, PREFIX) is took
