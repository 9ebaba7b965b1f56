"""The lean decode loop's samplers (saopd.rollout.sampling)."""

from __future__ import annotations

import math

import pytest
import torch

from saopd.config.rollout import HFRolloutConfig
from saopd.models.tiny import tiny_qwen3, tiny_tokenizer
from saopd.rollout import HFGenerateEngine, SamplingParams
from saopd.rollout.sampling import SAMPLERS, inverse_cdf_index, sample_inverse_cdf, sample_tokens

CHATS = [[{"role": "user", "content": "Alice has 3 apples and then 4 more. How many?"}],
         [{"role": "user", "content": "hi"}]]


def test_zero_probability_tokens_are_never_chosen_at_the_ends_of_u() -> None:
    # first and last entries have probability zero: u = 0 must not pick index 0, and u just
    # below 1 (where u * total can round up to the total) must not pick the trailing zeros
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0, 0.0]] * 4)
    u = torch.tensor([0.0, 0.25, 0.2499999, 1.0 - 2.0 ** -24])
    got = inverse_cdf_index(probs, u).tolist()
    assert got == [1, 3, 1, 3]


def test_u_at_or_past_the_total_is_capped_at_the_last_positive_token() -> None:
    probs = torch.tensor([[0.5, 0.5, 0.0]])
    assert inverse_cdf_index(probs, torch.tensor([1.0])).tolist() == [1]


def test_unnormalised_rows_are_sampled_by_their_own_total() -> None:
    probs = torch.tensor([[1.0, 3.0], [30.0, 10.0]])
    got = inverse_cdf_index(probs, torch.tensor([0.3, 0.7])).tolist()
    assert got == [1, 0]  # 0.3 * 4 = 1.2 >= 1: index 1; 0.7 * 40 = 28 < 30: index 0


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_frequencies_match_the_probabilities(sampler: str) -> None:
    torch.manual_seed(0)
    p = torch.tensor([0.05, 0.0, 0.4, 0.15, 0.0, 0.3, 0.1])
    n = 40_000
    draws = sample_tokens(p.expand(n, -1).contiguous(), sampler)
    counts = torch.bincount(draws, minlength=p.numel()).double()
    assert counts[p == 0].sum().item() == 0
    # each count within 5 binomial standard deviations of n * p (a seeded draw: no flake)
    sd = torch.sqrt(n * p.double() * (1 - p.double()))
    assert torch.all((counts - n * p.double()).abs() <= 5 * sd + 1e-9), counts


def test_inverse_cdf_is_seeded_by_the_generator() -> None:
    probs = torch.softmax(torch.randn(16, 50), dim=-1)
    a = sample_inverse_cdf(probs, torch.Generator().manual_seed(3))
    b = sample_inverse_cdf(probs, torch.Generator().manual_seed(3))
    c = sample_inverse_cdf(probs, torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.dtype == torch.int64 and a.shape == (16,)


def test_an_unknown_sampler_is_named() -> None:
    with pytest.raises(ValueError, match=r"rollout\.sampler='gumbel'"):
        sample_tokens(torch.ones(1, 3), "gumbel")


def test_float64_rows_are_sampled_in_float64() -> None:
    # a probability far below float32's resolution of the cumulative sum is still reachable
    p = torch.tensor([[1.0 - 1e-12, 1e-12]], dtype=torch.float64)
    assert inverse_cdf_index(p, torch.tensor([1.0 - 1e-13], dtype=torch.float64)).tolist() == [1]
    assert math.isclose(float(p.sum()), 1.0)


# the HF engine's lean decode loop with rollout.sampler=inverse_cdf


@pytest.fixture(scope="module")
def tiny() -> tuple[torch.nn.Module, object]:
    tok = tiny_tokenizer()
    return tiny_qwen3(tok, seed=0).eval(), tok


def test_the_engine_samples_the_models_first_token_distribution(tiny) -> None:
    """One new token for 3000 samples of a prompt: each token's frequency within 5 binomial
    standard deviations of the model's own softmax (temperature 0.7, so the warper is applied
    before the draw)."""
    model, tok = tiny
    engine = HFGenerateEngine(model, tok, sampler="inverse_cdf")
    assert engine.uses_lean_decode()
    n = 3000
    out = engine.generate(CHATS[:1], SamplingParams(n=n, temperature=0.7, max_new_tokens=1,
                                                    seed=5))
    first = torch.tensor([r.response_ids[0] for r in out.rollouts])
    ids = torch.tensor([engine.prompt_ids(CHATS[0])])
    with torch.no_grad():
        p = torch.softmax(model(input_ids=ids).logits[0, -1].double() / 0.7, dim=-1)
    counts = torch.bincount(first, minlength=p.numel()).double()
    sd = torch.sqrt(n * p * (1 - p))
    assert torch.all((counts - n * p).abs() <= 5 * sd + 1.0)
    # the recorded sampler log-probs are the raw (temperature 1) log-probs of those tokens
    raw = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), dim=-1).detach()
    got = torch.tensor([r.sampler_logprobs[0] for r in out.rollouts])
    torch.testing.assert_close(got, raw[first], rtol=1e-5, atol=1e-6)


def test_inverse_cdf_is_reproducible_per_seed_and_differs_from_multinomial(tiny) -> None:
    model, tok = tiny
    fast = HFGenerateEngine(model, tok, sampler="inverse_cdf")
    plain = HFGenerateEngine(model, tok)
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=10, seed=3)
    a, b, c = fast.generate(CHATS, sampling), fast.generate(CHATS, sampling), plain.generate(
        CHATS, sampling)
    ids = [[r.response_ids for r in x.rollouts] for x in (a, b, c)]
    assert ids[0] == ids[1]
    assert ids[0] != ids[2]  # another random stream


def test_inverse_cdf_is_refused_where_model_generate_samples(tiny) -> None:
    model, tok = tiny
    engine = HFGenerateEngine(model, tok, sampler="inverse_cdf", lean_decode=False)
    with pytest.raises(ValueError, match=r"rollout\.sampler='inverse_cdf' needs the lean decode"):
        engine.generate(CHATS, SamplingParams(n=1, max_new_tokens=2, seed=0))
    # greedy decoding draws nothing: allowed
    greedy = HFGenerateEngine(model, tok, sampler="inverse_cdf", lean_decode=False, greedy=True)
    assert len(greedy.generate(CHATS, SamplingParams(n=1, max_new_tokens=2)).rollouts) == 2


def test_the_config_checks_the_sampler_and_the_engine_gets_it(tiny) -> None:
    with pytest.raises(ValueError, match="sampler"):
        HFRolloutConfig(sampler="gumbel")
    model, tok = tiny
    from saopd.rollout.registry import build_engine

    engine = build_engine(HFRolloutConfig(sampler="inverse_cdf"), model, tok)
    assert engine.sampler == "inverse_cdf"
    with pytest.raises(ValueError, match="sampler"):
        HFGenerateEngine(model, tok, sampler="gumbel")


def test_the_training_evaluation_config_checks_its_sampler_and_batch() -> None:
    from saopd.config.eval import EvalDuringTrainingConfig

    conf = EvalDuringTrainingConfig(data_dir="x", sampler="inverse_cdf", batch_size=200)
    assert (conf.sampler, conf.batch_size) == ("inverse_cdf", 200)
    with pytest.raises(ValueError, match="sampler"):
        EvalDuringTrainingConfig(data_dir="x", sampler="gumbel")
    with pytest.raises(ValueError, match="batch_size"):
        EvalDuringTrainingConfig(data_dir="x", batch_size=0)
