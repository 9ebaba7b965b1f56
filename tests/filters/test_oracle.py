"""The testbeds' positive controls (saopd.filters.oracle): where the tic and its slot are, and
the oracle filters that remove the tic, its slot or the shortcut's decision token."""

from __future__ import annotations

import pytest
import torch

from saopd.filters import FILTERS
from saopd.filters.oracle import tic_positions, tic_token_ids
from saopd.models.tiny import tiny_tokenizer
from tests.conftest import random_signals

END, EOS = 2, 1
TIC = [3, 4, 5, EOS]  # a 3-token tic, then EOS


def ids_and_valid(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        valid[i, :len(r)] = True
    return ids, valid


def test_tic_positions() -> None:
    rows = [[6, 6, END, 3, 4, 5, EOS],   # the whole tic after the answer line
            [6, END, EOS],               # the slot holds EOS: active there, no tic token
            [6, END, 3, 4, 6, 6],        # a tic begun, then left at its third token
            [6, 6, 6, 6],                # no answer line: no slot
            [END, 6, END, 3, EOS]]       # only the first answer line has the slot
    ids, valid = ids_and_valid(rows)
    pos = tic_positions(ids, valid, END, TIC)
    act = [[j for j in range(len(r)) if pos.active[i, j]] for i, r in enumerate(rows)]
    tic = [[j for j in range(len(r)) if pos.tic[i, j]] for i, r in enumerate(rows)]
    assert act == [[3, 4, 5, 6], [2], [2, 3, 4], [], [1]]
    assert tic == [[3, 4, 5, 6], [], [2, 3], [], []]
    assert pos.offset[0, 3:7].tolist() == [0, 1, 2, 3] and pos.offset[0, :3].tolist() == [-1] * 3
    assert not bool((pos.active & ~valid).any())  # padding is never active


def test_oracles_remove_the_slot_or_the_tic() -> None:
    tok = tiny_tokenizer()
    end, tic = tic_token_ids(tok, "Wait, the answer is \\boxed{0}.", "}.")
    rows = [[9, end, *tic], [9, end, tic[-1]], [9, 9, 9]]
    ids, valid = ids_and_valid(rows)
    s = random_signals(3, ids.shape[1], valid_p=1.0)
    s.valid, s.response_ids = valid, ids
    masks = {}
    for target in ("slot", "tic"):
        f = FILTERS.build("oracle", target=target)
        with pytest.raises(ValueError, match="bind_tokenizer"):
            f(s)
        f.bind_tokenizer(tok)
        masks[target] = f(s).filtered
    assert masks["tic"][0, 2:2 + len(tic)].all() and int(masks["tic"].sum()) == len(tic)
    assert masks["slot"][1, 2] and not masks["tic"][1].any()  # the EOS at the slot
    assert int(masks["slot"].sum()) == len(tic) + 1 and not masks["slot"][2].any()
    with pytest.raises(ValueError, match=r"filter\.target must be one of"):
        FILTERS.build("oracle", target="all")


def test_shortcut_oracle_removes_the_first_solution_token() -> None:
    tok = tiny_tokenizer()
    pre = tok("Let us think step by step.\n", add_special_tokens=False)["input_ids"]
    short = tok("So the answer is \\boxed{3}.", add_special_tokens=False)["input_ids"]
    worked = tok("1 + 2 = 3\nSo the answer is \\boxed{3}.", add_special_tokens=False)["input_ids"]
    rows = [short, [*pre, *short], worked, [*pre, *worked]]
    ids, valid = ids_and_valid(rows)
    s = random_signals(4, ids.shape[1], valid_p=1.0)
    s.valid, s.response_ids = valid, ids
    got = {}
    for target in ("slot", "shortcut"):
        f = FILTERS.build("oracle_shortcut", target=target)
        f.bind_tokenizer(tok)
        got[target] = [[j for j in range(len(r)) if f(s).filtered[i, j]]
                       for i, r in enumerate(rows)]
    n = len(pre)
    assert got["slot"] == [[0], [n], [0], [n]]
    assert got["shortcut"] == [[0], [n], [], []]
    with pytest.raises(ValueError, match=r"filter\.target must be one of"):
        FILTERS.build("oracle_shortcut", target="all")
