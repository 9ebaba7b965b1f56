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


# ---- a teacher with its own chat template and renamed special tokens (issue 14, point 4) -----


@pytest.fixture(scope="module")
def deepseek_pair():
    from saopd.contexts import context_builder
    from saopd.models.tokenizers import qwen_tokenizer
    from saopd.models.vocab import check_vocabularies
    from tests.helpers.tokenizer_pairs import deepseek_style_tokenizer

    student_tok, teacher_tok = qwen_tokenizer(), deepseek_style_tokenizer()
    report = check_vocabularies(student_tok, teacher_tok)
    builder = context_builder(student_tok, teacher_tokenizer=teacher_tok,
                              response_id_map=report.response_id_map)
    student = tiny_qwen3(student_tok, layers=1, hidden=32, head_dim=16, seed=3).eval()
    teacher = tiny_qwen3(teacher_tok, layers=2, hidden=32, head_dim=16, seed=4).eval()
    messages = [[{"role": "user", "content": "What is 17 + 25?"}],
                [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": "Sort 3, 1, 2."}]]
    eos = student_tok.eos_token_id
    responses = [[*student_tok.encode("17 + 25 = 42. The answer is 42."), eos],
                 [*student_tok.encode("1, 2, 3"), eos]]
    return student_tok, teacher_tok, builder, student, teacher, messages, responses


def _plain_logprobs(model, ids: list[int], start: int, targets: list[int]) -> torch.Tensor:
    """Log-probs of ``targets`` at positions start-1 ... of one unpadded sequence."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    logp = logits.log_softmax(-1)
    return torch.stack([logp[start - 1 + i, t] for i, t in enumerate(targets)]).float()


def test_teacher_scores_its_own_template_with_mapped_ids(deepseek_pair):
    from saopd.config.step import StepConfig

    s_tok, t_tok, builder, student, teacher, messages, responses = deepseek_pair
    batch = builder.collate(messages, responses, step=StepConfig())
    tb = batch.teacher
    assert tb is not None and batch.teacher_view is tb
    mapped = [[151643 if i == s_tok.eos_token_id else i for i in r] for r in responses]
    for b, (msgs, resp) in enumerate(zip(messages, responses, strict=True)):
        # the student's contexts are what they were: its template + its ids
        s_prompt = s_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        s_ids = s_tok.encode(s_prompt, add_special_tokens=False) + resp
        assert batch.full.input_ids[b, : len(s_ids)].tolist() == s_ids
        # the teacher's: its template (BOS, <｜User｜>, <｜Assistant｜>) + the mapped ids,
        # the residual with its own empty user turn (the system turn dropped, as the student's)
        t_full = t_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert t_full.startswith("<｜begin▁of▁sentence｜>") and "<｜User｜>" in t_full
        t_ids = t_tok.encode(t_full, add_special_tokens=False) + mapped[b]
        assert tb.full.input_ids[b, : len(t_ids)].tolist() == t_ids
        t_res = t_tok.encode(t_tok.apply_chat_template(
            [{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False) + mapped[b]
        assert tb.residual.input_ids[b, : len(t_res)].tolist() == t_res
        assert tb.response_ids[b, -1 if b == 0 else len(resp) - 1] == 151643  # teacher EOS
    assert torch.equal(tb.response_mask, batch.response_mask)

    needs = ScoringNeeds(residual=True, teacher_entropy=True, kl=True)
    for stack in (False, True):
        frozen = score_frozen(batch, student=student, teacher=teacher, reference=None,
                              needs=needs, stack_teacher=stack, stack_max_padding=1.0)
        for b, resp in enumerate(responses):
            r = len(resp)
            starts = (int(tb.full.starts[b]), int(tb.residual.starts[b]))
            full = tb.full.input_ids[b, : int(tb.full.lengths[b])].tolist()
            res = tb.residual.input_ids[b, : int(tb.residual.lengths[b])].tolist()
            # a plain forward of the teacher on its own ids gives the same numbers, token for
            # token at the same response slots as the student's
            torch.testing.assert_close(frozen.lp_teacher[b, :r],
                                       _plain_logprobs(teacher, full, starts[0], mapped[b]),
                                       atol=1e-5, rtol=0)
            torch.testing.assert_close(frozen.lp_teacher_res[b, :r],
                                       _plain_logprobs(teacher, res, starts[1], mapped[b]),
                                       atol=1e-5, rtol=0)
            # the student scored its own residual context and its own ids
            s_res = batch.residual.input_ids[b, : int(batch.residual.lengths[b])].tolist()
            torch.testing.assert_close(
                frozen.lp_student_res[b, :r],
                _plain_logprobs(student, s_res, int(batch.residual.starts[b]), resp),
                atol=1e-5, rtol=0)
    # micro-batches carry the teacher's rows too
    assert batch.rows(slice(1, 2)).teacher.full.input_ids.shape[0] == 1


def test_same_tokenizer_teacher_contexts_score_exactly_as_before(setup):
    """Teacher contexts built with the student's own tokenizer are the student's contexts, and
    scoring them gives bit-identical results to the batch without them (the path every
    same-template pair takes)."""
    from saopd.config.step import StepConfig
    from saopd.contexts import TextContexts

    tok, teacher, student, messages, responses = setup
    plain = TextContexts(tok).collate(messages, responses, step=StepConfig())
    own = TextContexts(tok, teacher_tokenizer=tok).collate(messages, responses,
                                                           step=StepConfig())
    assert plain.teacher is None and plain.teacher_view is plain
    for name in ("input_ids", "attention_mask", "gather_index"):
        assert torch.equal(getattr(own.teacher.full, name), getattr(plain.full, name))
        assert torch.equal(getattr(own.teacher.residual, name), getattr(plain.residual, name))
    needs = ScoringNeeds(residual=True, teacher_entropy=True)
    a = score_frozen(plain, student=student, teacher=teacher, reference=None, needs=needs)
    b = score_frozen(own, student=student, teacher=teacher, reference=None, needs=needs)
    for name in ("lp_teacher", "lp_teacher_res", "lp_student_res", "entropy_teacher"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_student_pass_carries_the_exact_tails_of_the_teacher_top_k(setup):
    """With the teacher's head in the trainer both tails outside its top-K come from the whole
    vocabulary (exp(tail) + the listed mass = 1); with a service's lists the student's tail
    still does (same ids, same value) and the teacher's is absent, for the list-only floor."""
    from saopd.scoring.passes import TeacherScores

    tok, teacher, student, messages, responses = setup
    batch = collate_contexts(tok, messages, responses)
    needs = ScoringNeeds(teacher_top_k=4)
    mask = batch.response_mask
    with torch.no_grad():
        local = score_student(batch, score_frozen(batch, student=student, teacher=teacher,
                                                  reference=None, needs=needs),
                              student=student, needs=needs)
        for lp, tail in ((local.teacher_topk_lp_teacher, local.teacher_topk_tail_teacher),
                         (local.teacher_topk_lp_student, local.teacher_topk_tail_student)):
            total = lp.double().exp().sum(-1) + tail.double().exp()  # float32 pieces: ~1e-6
            torch.testing.assert_close(total[mask], torch.ones_like(total[mask]), rtol=1e-5,
                                       atol=0.0)
        served = TeacherScores(lp_teacher=local.lp_teacher, topk_ids=local.teacher_topk_ids,
                               topk_logprobs=local.teacher_topk_lp_teacher)
        frozen = score_frozen(batch, student=student, teacher=None, reference=None, needs=needs,
                              teacher_scores=served)
        remote = score_student(batch, frozen, student=student, needs=needs)
    assert remote.teacher_topk_tail_teacher is None
    torch.testing.assert_close(remote.teacher_topk_tail_student[mask],
                               local.teacher_topk_tail_student[mask], rtol=1e-6, atol=1e-6)


# ---- length buckets of right-padded CPU batches (bucketed_hidden) --------------------------------


def test_length_buckets_cover_every_row_once_shortest_first():
    from saopd.scoring.passes import length_buckets

    lengths = torch.tensor([5, 40, 7, 41, 6, 39, 8, 42])
    groups = length_buckets(lengths, max_buckets=4, forward_cost=0)
    rows = torch.cat(groups)
    assert sorted(rows.tolist()) == list(range(len(lengths)))
    maxima = [int(lengths[g].max()) for g in groups]
    assert maxima == sorted(maxima) and len(groups) > 1
    assert len(length_buckets(lengths, max_buckets=1)) == 1
    # a large fixed cost per forward keeps one group
    assert len(length_buckets(lengths, max_buckets=4, forward_cost=10_000)) == 1


@pytest.mark.parametrize("max_buckets", [1, 3])
def test_bucketed_hidden_equals_one_padded_forward(setup, max_buckets):
    """Rows grouped by length, cut and without the padding mask give the padded forward's
    hidden states at the response positions: bit for bit with one group, within float rounding
    with several; gradients too."""
    from saopd.scoring.passes import bucketed_hidden, length_buckets

    tok, _, student, messages, _ = setup
    g = torch.Generator().manual_seed(1)
    many = [messages[i % 3] for i in range(9)]
    responses = [torch.randint(4, len(tok), (n,), generator=g).tolist()
                 for n in (1, 90, 4, 77, 3, 85, 2, 80, 6)]
    batch = collate_contexts(tok, many, responses)
    ctx = batch.full
    assert (len(length_buckets(ctx.lengths, max_buckets=max_buckets)) > 1) == (max_buckets > 1)
    backbone = student.model
    plain = backbone(**ctx.model_inputs(), use_cache=False).last_hidden_state
    plain = plain.gather(1, ctx.gather_index[..., None].expand(-1, -1, plain.shape[-1]))
    ours = bucketed_hidden(backbone, ctx, max_buckets=max_buckets)
    mask = batch.response_mask
    if max_buckets == 1:
        assert torch.equal(ours[mask], plain[mask])
    else:
        torch.testing.assert_close(ours[mask], plain[mask], atol=1e-5, rtol=0)
    weight = torch.randn(plain.shape, generator=g)
    grads = []
    for hidden in (plain, ours):
        student.zero_grad(set_to_none=True)
        (hidden[mask] * weight[mask]).sum().backward(retain_graph=True)
        grads.append(student.model.layers[0].mlp.up_proj.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], atol=1e-4, rtol=1e-4)
    student.zero_grad(set_to_none=True)


def test_default_frozen_passes_are_bit_identical_to_masked_forwards(setup, monkeypatch):
    """By default (MAX_LENGTH_BUCKETS = 1) the passes without gradient drop the padding mask
    on CPU, and give exactly the masked forwards' scores."""
    import saopd.scoring.passes as scoring

    tok, teacher, student, messages, responses = setup
    batch = collate_contexts(tok, messages, responses)
    needs = ScoringNeeds(residual=True, teacher_entropy=True)
    kw = dict(student=student, teacher=teacher, reference=None, needs=needs)
    assert scoring.MAX_LENGTH_BUCKETS == 1
    ours = score_frozen(batch, **kw)
    monkeypatch.setattr(scoring, "MAX_LENGTH_BUCKETS", 0)
    masked = score_frozen(batch, **kw)
    for name in ("lp_teacher", "lp_teacher_res", "lp_student_res", "entropy_teacher"):
        assert torch.equal(getattr(ours, name), getattr(masked, name)), name
