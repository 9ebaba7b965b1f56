"""Oracle filters: positive controls that remove the tokens a testbed's ground truth names.

The tic testbed (:mod:`saopd.testbeds.tic`) plants a prior that is input-agnostic by
construction: after a response's first answer line (its token ``answer_end``, ``}.``), the
teacher continues with the **tic** (``\\nWait, the answer is \\boxed{0}.`` then EOS) at a fixed
rate. :func:`tic_positions` finds, from the response ids alone, where that prior is in play and
which tokens are the tic's; the teacher's mixture, the oracle filters and the ground truth of the
token records all use it. An oracle is a **positive control**, never a method: it shows whether
removing the prior's tokens can recover the harm at all, so that a method's null result can be
read against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from saopd.filters.base import FILTERS, FilterResult, TokenFilter, result_from_filtered
from saopd.signals.token_signals import TokenSignals

__all__ = ["OracleFilter", "ShortcutOracleFilter", "TicPositions", "shortcut_positions",
           "tic_positions", "tic_token_ids"]


@dataclass(frozen=True)
class TicPositions:
    """Where the tic prior acts in a batch of responses (all ``[B, R]``).

    Attributes:
        active: bool, True at the positions where the prior is in play (**): the slot and every
            position after it while the response has followed the tic so far.
        tic: bool, True at the active positions whose token is the tic's (a written tic, whole
            or begun; its EOS included); ``tic`` implies ``active``.
        offset: long, ``k = j - s`` at active positions (which tic token the prior offers),
            -1 elsewhere.
    """

    active: torch.Tensor
    tic: torch.Tensor
    offset: torch.Tensor


def tic_positions(response_ids: torch.Tensor, valid: torch.Tensor, answer_end_id: int,
                  tic_ids: Sequence[int]) -> TicPositions:
    """The slot and the tic's tokens of each response (module docstring).

    Args:
        response_ids: long ``[B, R]``, the response tokens y_j.
        valid: bool ``[B, R]``, True on real response tokens (padding is never active).
        answer_end_id: the token that closes the answer line (``}.``); the slot of a row is the
            position after its first valid occurrence (no occurrence: no slot).
        tic_ids: the tic's tokens, its EOS last (``L`` tokens).
    """
    if response_ids.shape != valid.shape or response_ids.dim() != 2:
        raise ValueError(f"response_ids {tuple(response_ids.shape)} and valid "
                         f"{tuple(valid.shape)} must both be [B, R]")
    if not tic_ids:
        raise ValueError("tic_ids must not be empty")
    b, r = response_ids.shape
    tic = torch.as_tensor(list(tic_ids), dtype=torch.long, device=response_ids.device)
    length = int(tic.numel())
    active = torch.zeros(b, r, dtype=torch.bool, device=response_ids.device)
    is_tic = torch.zeros_like(active)
    offset = torch.full((b, r), -1, dtype=torch.long, device=response_ids.device)
    ends = ((response_ids == answer_end_id) & valid).nonzero().tolist()
    seen: set[int] = set()
    for row, col in ends:  # row-major: the first hit of each row comes first
        if row in seen:
            continue
        seen.add(row)
        for k in range(length):
            j = col + 1 + k
            if j >= r or not bool(valid[row, j]):
                break
            active[row, j] = True
            offset[row, j] = k
            if int(response_ids[row, j]) != int(tic[k]):
                break  # the response left the tic: the prior is not in play after this
            is_tic[row, j] = True
    return TicPositions(active=active, tic=is_tic, offset=offset)


def tic_token_ids(tokenizer: Any, text: str, answer_end: str) -> tuple[int, list[int]]:
    """The answer-end token id and the tic's ids (``"\\n" + text``, then EOS) of an HF
    ``tokenizer``; ``ValueError`` when ``answer_end`` is not one token or there is no EOS."""
    end = tokenizer(answer_end, add_special_tokens=False)["input_ids"]
    if len(end) != 1:
        raise ValueError(f"tic.answer_end {answer_end!r} must be one token of the tokenizer, "
                         f"got {end}")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tic needs the tokenizer's EOS token, and it has none")
    ids = list(tokenizer("\n" + text, add_special_tokens=False)["input_ids"])
    return int(end[0]), [int(i) for i in ids] + [int(tokenizer.eos_token_id)]


class _TokenOracle(TokenFilter):
    """What the oracles share: a ``target`` among :attr:`targets`, token ids resolved from text
    by :meth:`bind_tokenizer` (:meth:`_resolve`), and a mask per target (:meth:`_masks`)."""

    requires: ClassVar[tuple[str, ...]] = ("response_ids",)
    targets: ClassVar[tuple[str, ...]] = ()
    target: str

    def __post_init__(self) -> None:
        if self.target not in self.targets:
            raise ValueError(f"filter.target must be one of {list(self.targets)}, got "
                             f"{self.target!r}")
        self._ids: tuple[int, list[int]] | None = None

    def bind_tokenizer(self, tokenizer: Any) -> None:
        self._ids = self._resolve(tokenizer)

    def _resolve(self, tokenizer: Any) -> tuple[int, list[int]]:
        raise NotImplementedError

    def _masks(self, signals: TokenSignals, ids: tuple[int, list[int]]
               ) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def apply(self, signals: TokenSignals, *,
              generator: torch.Generator | None = None) -> FilterResult:
        if self._ids is None:
            raise ValueError(f"the {self.name} filter names its tokens by text: "
                             "bind_tokenizer() must be called first (the training module does)")
        assert signals.response_ids is not None
        return result_from_filtered(signals, self._masks(signals, self._ids)[self.target])


@FILTERS.register("oracle")
@dataclass
class OracleFilter(_TokenOracle):
    """A **positive control**, not a method: removes the tokens the tic testbed's ground truth
    names (:func:`tic_positions`), to show whether removing the prior's tokens can recover the
    harm at all.

    ``target``: ``slot`` removes every position where the prior is in play (the slot, whatever
    the response wrote there, and the tic's tokens); ``tic`` removes only the tic's own tokens
    (where the response wrote it). ``text`` / ``answer_end``: the tic and the answer line's last
    token, as in the teacher's ``tic`` block; resolved to ids by :meth:`bind_tokenizer`.
    """

    label = "Oracle (positive control)"

    name: ClassVar[str] = "oracle"
    targets: ClassVar[tuple[str, ...]] = ("slot", "tic")
    target: str = "slot"
    text: str = "Wait, the answer is \\boxed{0}."
    answer_end: str = "}."

    def _resolve(self, tokenizer: Any) -> tuple[int, list[int]]:
        return tic_token_ids(tokenizer, self.text, self.answer_end)

    def _masks(self, signals: TokenSignals, ids: tuple[int, list[int]]
               ) -> dict[str, torch.Tensor]:
        assert signals.response_ids is not None
        pos = tic_positions(signals.response_ids, signals.valid, *ids)
        return {"slot": pos.active, "tic": pos.tic}


def shortcut_positions(response_ids: torch.Tensor, valid: torch.Tensor, decision_id: int,
                       prefix_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The first testbed's shortcut slot and its decision token (``[B, R]`` bool each).

    The slot is the response's first solution position: 0, or ``len(prefix_ids)`` when the
    response opens with ``prefix_ids`` (the preamble habit, newline included); the decision
    token is the slot when it holds ``decision_id`` (``So``: the answer line written before any
    digit, :func:`saopd.eval.habits.follows_shortcut`).
    """
    if response_ids.shape != valid.shape or response_ids.dim() != 2:
        raise ValueError(f"response_ids {tuple(response_ids.shape)} and valid "
                         f"{tuple(valid.shape)} must both be [B, R]")
    b, r = response_ids.shape
    slot = torch.zeros(b, r, dtype=torch.bool, device=response_ids.device)
    prefix = torch.as_tensor(list(prefix_ids), dtype=torch.long, device=response_ids.device)
    n = int(prefix.numel())
    for row in range(b):
        opens = n > 0 and n < r and bool(valid[row, :n].all()) and torch.equal(
            response_ids[row, :n], prefix)
        at = n if opens else 0
        if at < r and bool(valid[row, at]):
            slot[row, at] = True
    return slot, slot & (response_ids == decision_id)


@FILTERS.register("oracle_shortcut")
@dataclass
class ShortcutOracleFilter(_TokenOracle):
    """A **positive control** of the first testbed (the shortcut prior), not a method: removes
    the shortcut's slot or decision token (:func:`shortcut_positions`).

    ``target``: ``slot`` removes the first solution token of every response (whatever it is:
    the shortcut's ``So`` or the first digit of a worked line, where the prior teacher's
    shortcut probability lowers the digit's); ``shortcut`` removes only ``So`` where the response
    took the shortcut. ``decision`` / ``preamble``: the shortcut's first token and the preamble
    habit that may precede it (with its newline), resolved to ids by :meth:`bind_tokenizer`.
    """

    label = "Oracle: shortcut (positive control)"

    name: ClassVar[str] = "oracle_shortcut"
    targets: ClassVar[tuple[str, ...]] = ("slot", "shortcut")
    target: str = "slot"
    decision: str = "So"
    preamble: str = "Let us think step by step.\n"

    def _resolve(self, tokenizer: Any) -> tuple[int, list[int]]:
        decision = tokenizer(self.decision, add_special_tokens=False)["input_ids"]
        if len(decision) != 1:
            raise ValueError(f"filter.decision {self.decision!r} must be one token of the "
                             f"tokenizer, got {decision}")
        prefix = tokenizer(self.preamble, add_special_tokens=False)["input_ids"]
        return int(decision[0]), [int(i) for i in prefix]

    def _masks(self, signals: TokenSignals, ids: tuple[int, list[int]]
               ) -> dict[str, torch.Tensor]:
        assert signals.response_ids is not None
        slot, taken = shortcut_positions(signals.response_ids, signals.valid, *ids)
        return {"slot": slot, "shortcut": taken}
