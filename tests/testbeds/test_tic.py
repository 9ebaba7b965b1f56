"""The tic testbed (saopd.testbeds.tic): the teacher's mixture (checked against the mixture of
whole-response distributions it stands for), its input-agnosticism and the data/training
stages' tic. The prior's positions and the oracle filters: tests/filters/test_oracle.py."""

from __future__ import annotations

import math
import random

import pytest
import torch

from saopd.config.model import ModelConfig, TicConfig
from saopd.filters.oracle import tic_token_ids
from saopd.models.tiny import tiny_qwen3, tiny_tokenizer
from saopd.stages.testbed import (
    Problem,
    make_problems,
    render_response,
    train_testbed_model,
)
from saopd.testbeds.tic import TicPriorLM
from tests.filters.test_oracle import END, EOS, TIC, ids_and_valid

V = 7


def _sequence_mixture(lp: torch.Tensor, y: list[int], rate: float) -> torch.Tensor:
    """log p'(v | y_<j) for every j and v, from the distribution over whole responses
    P'(y) = P_T(y_<s) [(1 - r) P_T(y_>=s | y_<s) + r 1[y_>=s = tic]] (P_T(y) without a slot):
    the ratio of prefix probabilities P'(y_<j, v) / P'(y_<j), each prefix's slot its own.
    ``lp`` [R, V]: the base model's log-probs along ``y``."""
    p = lp.double().exp()

    def prefix(seq: list[int]) -> float:
        base = math.prod(float(p[i, t]) for i, t in enumerate(seq))
        tic = 0.0
        s = seq.index(END) + 1 if END in seq else None  # the slot of this very sequence
        if s is not None and len(seq) >= s and seq[s:] == TIC[:len(seq) - s]:
            tic = math.prod(float(p[i, t]) for i, t in enumerate(seq[:s]))
        return base if s is None else (1 - rate) * base + rate * tic

    out = torch.empty(len(y), V, dtype=torch.float64)
    for j in range(len(y)):
        den = prefix(y[:j])
        for v in range(V):
            out[j, v] = math.log(prefix([*y[:j], v]) / den)
    return out


@pytest.mark.parametrize("row", [[6, 6, END, 3, 4, 5, EOS], [6, END, EOS], [6, END, 3, 4, 6],
                                 [6, 6, 6]])
@pytest.mark.parametrize("rate", [0.3, 0.05])
def test_mixture_is_the_whole_response_mixture(row: list[int], rate: float) -> None:
    g = torch.Generator().manual_seed(len(row))
    lp = torch.log_softmax(2 * torch.randn(1, len(row), V, generator=g), dim=-1)
    lp[0, :, 3] -= 3.0  # the base model rarely writes the tic's first token
    lp = torch.log_softmax(lp, dim=-1)
    base = tiny_qwen3(tiny_tokenizer(), layers=1, hidden=32, heads=1, kv_heads=1, head_dim=32)
    model = TicPriorLM(base, rate=rate, answer_end_id=END, tic_ids=TIC)
    ids, valid = ids_and_valid([row])
    got = model.mixed_logprobs(lp, ids, valid)[0].double()
    want = _sequence_mixture(lp[0], row, rate)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.exp().sum(-1), torch.ones(len(row), dtype=torch.float64),
                               rtol=1e-6, atol=1e-6)
    if END in row:
        slot = row.index(END) + 1
        assert float(got[slot, 3].exp()) >= rate  # r + (1 - r) p_T(tic_0)


def test_the_prior_at_the_slot_does_not_depend_on_the_input() -> None:
    """Two contexts whose base models differ everywhere (the full and the residual context, say)
    get the same tic probability at the slot up to (1 - r) x the base's own difference there:
    the teacher's grounding gap at the tic onset is 0 when the base never writes the tic."""
    base = tiny_qwen3(tiny_tokenizer(), layers=1, hidden=32, heads=1, kv_heads=1, head_dim=32)
    model = TicPriorLM(base, rate=0.3, answer_end_id=END, tic_ids=TIC)
    ids, valid = ids_and_valid([[6, END, 3, 4, 5, EOS]])
    g = torch.Generator().manual_seed(0)
    gaps = []
    for p_tic in (1e-6, 1e-3):
        lp_a = torch.log_softmax(torch.randn(1, 6, V, generator=g), dim=-1)
        lp_b = torch.log_softmax(torch.randn(1, 6, V, generator=g), dim=-1)
        for lp in (lp_a, lp_b):  # the base gives the tic's first token p_tic at the slot
            rest = torch.logsumexp(torch.cat([lp[0, 2, :3], lp[0, 2, 4:]]), 0)
            lp[0, 2] = lp[0, 2] - rest + math.log1p(-p_tic)
            lp[0, 2, 3] = math.log(p_tic)
        a = model.mixed_logprobs(lp_a, ids, valid)[0, 2, 3]
        b = model.mixed_logprobs(lp_b, ids, valid)[0, 2, 3]
        gaps.append(abs(float(a - b)))
        assert float(a) == pytest.approx(math.log(0.3 + 0.7 * p_tic), rel=1e-5)
    assert gaps[0] < 1e-6  # the base's difference at the slot is 0 here: the teacher's is too


def test_scoring_through_real_contexts() -> None:
    """Through saopd's contexts and scoring hook: at rate 0 the wrapper is the base model; at
    rate 0.3 the teacher's tic onset moves between the full and the residual context by at most
    what (**) allows for the base's own move there, (1 - r) / r x |dp_T|, and the tokens away
    from the slot are scored as the base scores them."""
    from saopd.contexts.text import collate_contexts
    from saopd.scoring.passes import response_source
    from saopd.signals import score_tokens

    tok = tiny_tokenizer()
    base = tiny_qwen3(tok, layers=1, hidden=32, heads=1, kv_heads=1, head_dim=32, seed=3)
    end, tic = tic_token_ids(tok, "Wait, the answer is \\boxed{0}.", "}.")
    answer = tok("7 + 5 = 12\nSo the answer is \\boxed{12}.", add_special_tokens=False)
    rows = [answer["input_ids"] + tic, answer["input_ids"] + [int(tok.eos_token_id)]]
    batch = collate_contexts(tok, [[{"role": "user", "content": "Compute 7 + 5."}]] * 2, rows)
    slot = len(answer["input_ids"])

    def lp(model: torch.nn.Module, ctx) -> torch.Tensor:
        return score_tokens(response_source(model, ctx), batch.response_ids).logprobs

    control = TicPriorLM(base, rate=0.0, answer_end_id=end, tic_ids=tic)
    assert response_source(control, batch.full) is not None
    torch.testing.assert_close(lp(control, batch.full), lp(base, batch.full))
    prior = TicPriorLM(base, rate=0.3, answer_end_id=end, tic_ids=tic)
    full, res = lp(prior, batch.full), lp(prior, batch.residual)
    base_full, base_res = lp(base, batch.full), lp(base, batch.residual)
    dp = abs(float((base_full[0, slot].exp() - base_res[0, slot].exp()).detach()))
    assert abs(float((full[0, slot] - res[0, slot]).detach())) <= (0.7 / 0.3) * dp + 1e-5
    assert float(full[0, slot]) >= math.log(0.3) - 1e-6
    torch.testing.assert_close(full[:, :slot], base_full[:, :slot], rtol=1e-4, atol=1e-5)
    # the slot's EOS in row 1 keeps 1 - r of its base probability
    torch.testing.assert_close(full[1, slot], base_full[1, slot] + math.log(0.7), rtol=1e-4,
                               atol=1e-5)
    with pytest.raises(ValueError, match="plain forward"):
        prior(input_ids=batch.full.input_ids)


def test_bad_tic_configs_are_refused() -> None:
    with pytest.raises(ValueError, match=r"tic.rate must be a number in \[0, 1\)"):
        TicConfig(rate=1.0)
    with pytest.raises(ValueError, match="one line"):
        TicConfig(text="a\nb")
    with pytest.raises(ValueError, match=r"model\.planted and model\.tic"):
        ModelConfig(name_or_path="x", planted={}, tic=TicConfig())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be one token"):
        tic_token_ids(tiny_tokenizer(), "Wait.", "answer is")


def test_the_tic_is_written_after_the_answer_line_and_graded_as_the_answer() -> None:
    from saopd.eval.grading import grade_exact_phrases

    text, _ = render_response(Problem(347, 85), [], 0.0, random.Random(0),
                              tic="Wait, the answer is \\boxed{0}.")
    assert text.endswith("So the answer is \\boxed{432}.\nWait, the answer is \\boxed{0}.")
    grade = grade_exact_phrases(text, "432", {"tic": "Wait, the answer is \\boxed{0}."})
    assert not grade.correct and grade.answer == "0" and grade.phrases == {"tic": 1.0}


def _tiny_trained(rate: float | None) -> list[torch.Tensor]:
    tok = tiny_tokenizer()
    model = tiny_qwen3(tok, layers=1, hidden=32, heads=1, kv_heads=1, head_dim=32, seed=0)
    extra = {} if rate is None else {"tic_rate": rate, "tic": "Wait, the answer is \\boxed{0}."}
    train_testbed_model(model, tok, make_problems(32, max_digits=2, seed=0), [],
                        habit_rate=0.5, residual_share=0.2, noise_share=0.3, steps=2,
                        batch_size=4, lr=1e-3, seed=0, **extra)
    return [p.detach().clone() for p in model.parameters()]


def test_tic_rate_zero_trains_exactly_as_without_it() -> None:
    default = _tiny_trained(None)
    assert all(torch.equal(a, b) for a, b in zip(_tiny_trained(0.0), default, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(_tiny_trained(1.0), default, strict=True))


def test_token_sources_mark_the_tic_and_its_slot() -> None:
    from saopd.eval.habits import Habit
    from saopd.testbeds.arithmetic import SourceCounts, TicTruth, selection_by_source, token_sources

    tok = tiny_tokenizer()
    end, tic = tic_token_ids(tok, "Wait, the answer is \\boxed{0}.", "}.")
    truth = TicTruth(end, tuple(tic))
    habits = [Habit("preamble", "Let us think step by step.", "start")]
    answer = tok("1 + 2 = 3\nSo the answer is \\boxed{3}.", add_special_tokens=False)["input_ids"]
    for ids, want in (([*answer, *tic], ["tic"] * len(tic)),
                      ([*answer, tic[-1]], ["tic_slot"]),
                      ([*answer, *tic[:3], 9], ["tic"] * 3 + ["tic_slot"])):
        tokens = [tok.decode([i]) for i in ids]
        src = token_sources(tokens, habits, None, truth, ids)
        assert src[len(answer):] == want
        assert src[0] == "slot" and set(src[1:len(answer)]) == {"grounded"}
    with pytest.raises(ValueError, match="one per token"):
        token_sources(tokens, habits, None, truth, ids[:-1])
    rec = {"tokens": tokens, "response_ids": ids, "a_full": [0.5] * len(ids),
           "a_res": [0.5] * len(ids), "filtered": [False] * (len(ids) - 1) + [True]}
    counts: SourceCounts = selection_by_source([rec], habits, tic=truth)
    assert counts.valid["tic"] == 3 and counts.filtered["tic_slot"] == 1
