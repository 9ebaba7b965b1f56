"""The teacher's full and residual passes stacked into one forward (score_frozen's
``stack_teacher``) give the two passes' scores."""

from __future__ import annotations

import pytest
import torch

from saopd.config.model import PlantedConfig
from saopd.contexts.text import collate_contexts
from saopd.models.tiny import tiny_qwen3, tiny_tokenizer
from saopd.scoring.passes import ScoringNeeds, score_frozen, score_student, stack_contexts
from saopd.testbeds.planted import plant_priors

PROMPTS = ["Alice has 3 apples and buys 2 more books.", "Bob sells 7 marbles to Maria.",
           "The farmer keeps 12 stones."]


@pytest.fixture(scope="module")
def setup():
    tok = tiny_tokenizer()
    teacher = tiny_qwen3(tok, layers=2, hidden=64, seed=5).eval()
    student = tiny_qwen3(tok, layers=1, hidden=64, seed=6).eval()
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(4, len(tok), (n,), generator=g).tolist() for n in (9, 4, 13)]
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    return tok, teacher, student, messages, responses


@pytest.mark.parametrize("planted", [False, True])
def test_stacked_equals_two_passes(setup, planted):
    tok, teacher, student, messages, responses = setup
    if planted:
        teacher = plant_priors(teacher, tok, PlantedConfig(spurious_tokens=[" so", " step"]))
    batch = collate_contexts(tok, messages, responses)
    needs = ScoringNeeds(residual=True, teacher_entropy=True, kl=True)
    kw = dict(student=student, teacher=teacher, reference=None, needs=needs)
    two = score_frozen(batch, **kw)
    one = score_frozen(batch, stack_teacher=True, stack_max_padding=1.0, **kw)
    mask = batch.response_mask
    for name in ("lp_teacher", "lp_teacher_res", "lp_student_res", "entropy_teacher"):
        torch.testing.assert_close(getattr(one, name)[mask], getattr(two, name)[mask],
                                   atol=1e-5, rtol=0)
    assert one.teacher_head.hidden.shape[0] == len(responses)  # the full rows only
    with torch.no_grad():
        kl_one = score_student(batch, one, student=student, needs=needs).kl
        kl_two = score_student(batch, two, student=student, needs=needs).kl
    torch.testing.assert_close(kl_one[mask], kl_two[mask], atol=1e-5, rtol=0)


def test_stacking_pads_on_the_right_and_keeps_positions(setup):
    tok, _, _, messages, responses = setup
    batch = collate_contexts(tok, messages, responses)
    both = stack_contexts(batch.full, batch.residual)
    b, t = batch.full.input_ids.shape
    assert both.input_ids.shape == (2 * b, max(t, batch.residual.input_ids.shape[1]))
    t_res = batch.residual.input_ids.shape[1]
    assert torch.equal(both.input_ids[b:, :t_res], batch.residual.input_ids)
    assert int(both.attention_mask[b:, t_res:].sum()) == 0
    assert torch.equal(both.gather_index[b:], batch.residual.gather_index)


def test_falls_back_when_padding_would_be_large(setup, monkeypatch):
    tok, teacher, student, messages, responses = setup
    batch = collate_contexts(tok, messages, responses)
    calls = []
    import saopd.scoring.passes as scoring

    real = scoring.stack_contexts
    monkeypatch.setattr(scoring, "stack_contexts", lambda *a: calls.append(1) or real(*a))
    needs = ScoringNeeds(residual=True)
    score_frozen(batch, student=student, teacher=teacher, reference=None, needs=needs,
                 stack_teacher=True, stack_max_padding=0.0)
    assert not calls  # full and residual lengths differ: two passes
    score_frozen(batch, student=student, teacher=teacher, reference=None, needs=needs,
                 stack_teacher=True, stack_max_padding=1.0)
    assert calls == [1]
