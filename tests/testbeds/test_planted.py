"""The planted-prior teacher (saopd.testbeds.planted): what it adds, where, and that saopd's
chunked scoring sees exactly what a plain forward with the bias added gives."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from saopd.config.model import ModelConfig, PlantedConfig
from saopd.contexts.batch import gather_response_logprobs
from saopd.contexts.text import collate_contexts
from saopd.models.factory import build_model
from saopd.models.tiny import tiny_qwen3, tiny_tokenizer
from saopd.scoring.passes import ScoringNeeds, response_source, score_frozen, score_student
from saopd.signals import LMHead, score_tokens
from saopd.testbeds.planted import PlantedPriorLM, plant_priors, single_token_ids
from tests.helpers.tolerance import assert_float_close

SPURIOUS = [" so", " therefore", " step", " first", " finally"]
PROMPTS = ["Alice has 3 apples and buys 2 more books.", "Bob sells 7 marbles to Maria."]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def base(tok):
    return tiny_qwen3(tok, layers=2, hidden=64, seed=3).eval()


def planted(base, tok, *, spurious: float = 3.0, grounded: float = 4.0) -> PlantedPriorLM:
    return plant_priors(base, tok, PlantedConfig(spurious_tokens=SPURIOUS,
                                                 spurious_bonus=spurious,
                                                 grounded_bonus=grounded)).eval()


def batch_for(tok, responses: list[list[int]]):
    messages = [[{"role": "user", "content": p}] for p in PROMPTS][: len(responses)]
    return collate_contexts(tok, messages, responses)


def responses(tok) -> list[list[int]]:
    """Responses that contain spurious tokens, prompt tokens and other tokens."""
    sp = single_token_ids(tok, SPURIOUS)
    words = tok(" so Alice has apples then the answer is 5 therefore books step",
                add_special_tokens=False)["input_ids"]
    other = tok(" Bob sells marbles finally first so the total", add_special_tokens=False)[
        "input_ids"]
    assert set(sp) & set(words) and set(sp) & set(other)
    return [words, other]


def expected_prompt_ids(tok, text: str, spurious: list[int]) -> set[int]:
    """The grounded set, derived independently: the prompt's tokens minus whitespace-only ones,
    special tokens and the spurious set."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out = set()
    for i in ids:
        if i in tok.all_special_ids or i in spurious:
            continue
        if tok.convert_tokens_to_string(tok.convert_ids_to_tokens([i])).strip():
            out.add(i)
    return out


def test_bias_is_spurious_everywhere_and_grounded_only_after_the_prompt(base, tok):
    model = planted(base, tok)
    batch = batch_for(tok, responses(tok))
    sp = single_token_ids(tok, SPURIOUS)
    for ctx, has_prompt in ((batch.full, True), (batch.residual, False)):
        with torch.no_grad():
            got = model(**ctx.model_inputs()).logits - base(**ctx.model_inputs()).logits
        for row in range(2):
            n = int(ctx.lengths[row])
            want = torch.zeros(n, got.shape[-1])
            want[:, sp] += 3.0
            if has_prompt:
                prompt = sorted(expected_prompt_ids(tok, PROMPTS[row], sp))
                assert prompt  # the test means something only with a non-empty prompt set
                # the user turn closes at its <|im_end|>; the bias starts there (causal)
                ids = ctx.input_ids[row, :n].tolist()
                end = ids.index(tok.convert_tokens_to_ids("<|im_end|>"))
                want[end:, prompt] += 4.0
            torch.testing.assert_close(got[row, :n], want, atol=1e-5, rtol=0)


def test_chunked_scoring_equals_plain_forward_with_the_bias(base, tok):
    model = planted(base, tok)
    batch = batch_for(tok, responses(tok))
    for ctx in (batch.full, batch.residual):
        src = response_source(model, ctx)
        assert isinstance(src, LMHead)
        with torch.no_grad():
            logits = base(**ctx.model_inputs()).logits + model.logit_bias(ctx.input_ids,
                                                                           ctx.attention_mask)
            got = score_tokens(src, batch.response_ids, entropy=True, chunk_size=5)
        want = gather_response_logprobs(logits, ctx.gather_index, batch.response_ids)
        rows = logits.gather(1, ctx.gather_index[..., None].expand(-1, -1, logits.shape[-1]))
        p = rows.log_softmax(-1)
        want_h = -(p.exp() * p).sum(-1)
        mask = batch.response_mask
        torch.testing.assert_close(got.logprobs[mask], want[mask], atol=1e-4, rtol=0)
        torch.testing.assert_close(got.entropy[mask], want_h[mask], atol=1e-4, rtol=0)


def test_head_rows_can_be_sliced_like_a_plain_head(base, tok):
    """Micro-batching slices the teacher head's hidden rows only (FrozenScores.rows); the
    per-row bias must follow the row, not the slice index."""
    model = planted(base, tok)
    batch = batch_for(tok, responses(tok))
    with torch.no_grad():
        src = response_source(model, batch.full)
        whole = score_tokens(src, batch.response_ids).logprobs
        second = dataclasses.replace(src, hidden=src.hidden[1:2])
        part = score_tokens(second, batch.response_ids[1:2]).logprobs
    # one row through the head's GEMM instead of two: another row blocking (and summation order
    # on some CPUs' kernels), so a few float32 ulps of the log-probs' magnitude, not a fixed 1e-6
    assert_float_close(part, whole[1:2], ulps=8)


def signals_against(model, base, batch):
    needs = ScoringNeeds(residual=True)
    with torch.no_grad():
        frozen = score_frozen(batch, student=base, teacher=model, reference=None, needs=needs)
        return score_student(batch, frozen, student=base, needs=needs)


def test_spurious_bias_survives_prompt_removal(base, tok):
    """Student = the unbiased model, so A is the bias's effect alone: on spurious tokens
    A_full ~ -s in both contexts and the grounding gap is |log Z_full - log Z_res|, Z = the
    base's expected exp(bias); both computed here from the base's own logits."""
    model = planted(base, tok, spurious=3.0, grounded=0.0)
    batch = batch_for(tok, responses(tok))
    sig = signals_against(model, base, batch)
    sp = torch.tensor(single_token_ids(tok, SPURIOUS))
    on_sp = torch.isin(batch.response_ids, sp) & batch.response_mask
    assert int(on_sp.sum()) >= 4

    def log_z(ctx):
        with torch.no_grad():
            logits = base(**ctx.model_inputs()).logits
        rows = logits.gather(1, ctx.gather_index[..., None].expand(-1, -1, logits.shape[-1]))
        return torch.logsumexp(rows.log_softmax(-1) + model.spurious_bias, dim=-1)  # [B, R]

    gap = sig.grounding_gap
    want_gap = (log_z(batch.full) - log_z(batch.residual)).abs()
    torch.testing.assert_close(gap[on_sp], want_gap[on_sp], atol=1e-4, rtol=0)
    assert float(sig.a_full[on_sp].abs().min()) > 2.0  # large divergence ...
    assert float(gap[on_sp].max()) < 0.1  # ... that does not depend on the input


def test_grounded_bias_vanishes_with_prompt_removal(base, tok):
    model = planted(base, tok, spurious=0.0, grounded=4.0)
    batch = batch_for(tok, responses(tok))
    sig = signals_against(model, base, batch)
    sp = single_token_ids(tok, SPURIOUS)
    in_prompt = torch.zeros_like(batch.response_mask)
    for row in range(2):
        ids = torch.tensor(sorted(expected_prompt_ids(tok, PROMPTS[row], sp)))
        in_prompt[row] = torch.isin(batch.response_ids[row], ids)
    in_prompt &= batch.response_mask
    assert int(in_prompt.sum()) >= 3
    # residual: no bias at all, so the teacher equals the student there
    torch.testing.assert_close(sig.a_res[batch.response_mask],
                               torch.zeros(int(batch.response_mask.sum())), atol=1e-5, rtol=0)
    # full: prompt tokens get +4 before normalisation, so A_full <= -4 + log(1 + (e^4 - 1))
    gap = sig.grounding_gap[in_prompt]
    assert float(gap.min()) > 2.0
    assert float(gap.max()) <= 4.0 + 1e-4
    others = batch.response_mask & ~in_prompt
    # other tokens only lose the normaliser's mass: A_full = log Z > 0, smaller than 4
    a_other = sig.a_full[others]
    assert float(a_other.min()) > 0 and float(a_other.max()) < 4.0


def test_build_model_wraps_from_config(tok):
    cfg = ModelConfig(tiny="qwen3", planted=PlantedConfig(spurious_tokens=SPURIOUS,
                                                          spurious_bonus=2.5))
    model, tokenizer = build_model(cfg)
    assert isinstance(model, PlantedPriorLM)
    sp = single_token_ids(tokenizer, SPURIOUS)
    assert sorted(model.spurious_bias.nonzero()[:, 0].tolist()) == sorted(sp)
    assert float(model.spurious_bias[sp[0]]) == 2.5
    assert model.get_output_embeddings() is model.base.get_output_embeddings()


@pytest.mark.parametrize("bad, match", [
    ({"spurious_tokens": ["Alice has"]}, "single token"),
    ({"spurious_bonus": -1.0}, "spurious_bonus"),
    ({"grounded_bonus": float("nan")}, "grounded_bonus"),
    ({"turn_end": ""}, "turn_end"),
])
def test_bad_config_is_refused(base, tok, bad, match):
    with pytest.raises(ValueError, match=match):
        plant_priors(base, tok, PlantedConfig(**{"spurious_tokens": SPURIOUS, **bad}))


def test_kv_cache_is_refused_with_the_grounded_bias(base, tok):
    model = planted(base, tok)
    ids = torch.tensor([[1, 5, 6]])
    with pytest.raises(ValueError, match="KV cache"):
        model(ids, past_key_values=object())


def test_vision_model_cannot_be_planted():
    with pytest.raises(ValueError, match="text models only"):
        ModelConfig(tiny="qwen2_vl", planted=PlantedConfig())
