"""HFGenerateEngine: shapes and grouping, sampler log-probs equal to teacher-forced scoring and
untempered, seeding without touching the global RNG, train/eval mode and grad state restored,
prompt truncation modes, greedy decoding against manual argmax, load_weights."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import math

import pytest
import torch

from saopd.models.tiny import tiny_llama, tiny_qwen3, tiny_tokenizer
from saopd.rollout import (
    HFGenerateEngine,
    Rollout,
    RolloutBatch,
    RolloutEngine,
    SamplingParams,
    default_stop_token_ids,
)
from tests.helpers.tolerance import assert_float_close

EOS = 2  # tiny tokenizer: <|im_end|>
CHATS = [
    [{"role": "user", "content": "Alice has 3 apples and then 4 more. How many apples are there?"}],
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Please solve step by step: 12 * 7"},
    ],
]
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    ),
]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _eos_bias(model, bias: float, token: int = EOS):
    """Add ``bias`` to one logit of every forward pass (generate and teacher forcing alike)."""
    head = model.get_output_embeddings()

    def hook(_module, _inputs, output):
        out = output.clone()
        out[..., token] += bias
        return out

    return head.register_forward_hook(hook)


def _model(tok, kind: str = "qwen3", *, eos_bias: float = 4.0, device: str = "cpu", seed: int = 0):
    model = (tiny_qwen3 if kind == "qwen3" else tiny_llama)(tok, seed=seed).to(device)
    if eos_bias:
        _eos_bias(model, eos_bias)
    return model


def _teacher_forced(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + response], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(response), device=device)
    return lp[pos, torch.tensor(response, device=device)].cpu()


def _manual_greedy(model, prompt: list[int], max_new: int, stop: tuple[int, ...]):
    """Argmax decoding with a full forward pass per token (no cache, no padding)."""
    device = next(model.parameters()).device
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, -1].float()
            nxt = int(logits.argmax())
            lps.append(float(torch.log_softmax(logits, -1)[nxt]))
            ids.append(nxt)
            if nxt in stop:
                break
    return ids[len(prompt) :], lps


def _check_rollout(r: Rollout, stop: tuple[int, ...], max_new: int) -> None:
    assert 1 <= len(r.response_ids) <= max_new
    assert r.sampler_logprobs is not None and len(r.sampler_logprobs) == len(r.response_ids)
    assert all(lp <= 0 and math.isfinite(lp) for lp in r.sampler_logprobs)
    n_stop = sum(t in stop for t in r.response_ids)
    if r.finished:
        assert r.response_ids[-1] in stop and n_stop == 1
    else:
        assert n_stop == 0 and len(r.response_ids) == max_new


# --------------------------------------------------------------------------------------------------
# shapes, counts, grouping


def test_shapes_counts_and_grouping(tok):
    engine = HFGenerateEngine(_model(tok), tok)
    assert isinstance(engine, RolloutEngine)
    sampling = SamplingParams(n=4, max_new_tokens=12, seed=3)
    batch = engine.generate(CHATS, sampling)
    assert isinstance(batch, RolloutBatch)
    assert batch.messages == CHATS
    assert [r.prompt_index for r in batch.rollouts] == [0] * 4 + [1] * 4 + [2] * 4
    assert batch.num_truncated_prompts == batch.num_skipped_prompts == 0
    for r in batch.rollouts:
        _check_rollout(r, engine.stop_token_ids, 12)
    finished = [r.finished for r in batch.rollouts]
    assert any(finished) and not all(finished)  # the EOS bias makes both kinds likely
    assert batch.row_messages() == [CHATS[r.prompt_index] for r in batch.rollouts]
    lengths = batch.response_lengths()
    assert lengths.tolist() == [len(r.response_ids) for r in batch.rollouts]
    padded = batch.sampler_logprobs(12)
    assert padded is not None and padded.shape == (12, 12)


def test_chunked_batches_match_one_batch(tok):
    """Chunking and left padding do not change greedy outputs (beyond float noise)."""
    model = _model(tok, "llama")
    sampling = SamplingParams(n=2, max_new_tokens=10)
    whole = HFGenerateEngine(model, tok, greedy=True).generate(CHATS, sampling)
    chunked = HFGenerateEngine(model, tok, greedy=True, batch_size=1).generate(CHATS, sampling)
    assert [r.prompt_index for r in chunked.rollouts] == [0, 0, 1, 1, 2, 2]
    for a, b in zip(whole.rollouts, chunked.rollouts, strict=True):
        assert a.response_ids == b.response_ids and a.finished == b.finished
        torch.testing.assert_close(
            torch.tensor(a.sampler_logprobs), torch.tensor(b.sampler_logprobs), atol=1e-5, rtol=0
        )


def test_empty_response_is_a_single_eos(tok):
    engine = HFGenerateEngine(_model(tok, eos_bias=40.0), tok)
    batch = engine.generate(CHATS[:2], SamplingParams(n=2, max_new_tokens=5, seed=0))
    for r in batch.rollouts:
        assert r.response_ids == [EOS] and r.finished
        assert r.sampler_logprobs == pytest.approx([0.0], abs=1e-6)


def test_no_prompts(tok):
    batch = HFGenerateEngine(_model(tok), tok).generate([], SamplingParams())
    assert batch.messages == [] and batch.rollouts == []


# --------------------------------------------------------------------------------------------------
# sampler log-probs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.6, 0.9), (1.7, 1.0)])
def test_sampler_logprobs_equal_teacher_forcing(tok, device, kind, temperature, top_p):
    """Raw (untempered) log-probs of the sampled tokens, as a teacher-forced forward pass of the
    same model gives them: usable as importance-ratio denominators."""
    model = _model(tok, kind, device=device)
    engine = HFGenerateEngine(model, tok)
    sampling = SamplingParams(
        n=3, temperature=temperature, top_p=top_p, max_new_tokens=10, seed=11
    )
    batch = engine.generate(CHATS, sampling)
    for r in batch.rollouts:
        prompt = engine.prompt_ids(CHATS[r.prompt_index])
        ref = _teacher_forced(model, prompt, r.response_ids)
        torch.testing.assert_close(torch.tensor(r.sampler_logprobs), ref, atol=1e-5, rtol=0)
        if temperature != 1.0:  # and not the tempered ones
            device_ = next(model.parameters()).device
            ids = torch.tensor([prompt + r.response_ids], device=device_)
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0].float() / temperature
            pos = torch.arange(len(prompt) - 1, len(ids[0]) - 1, device=device_)
            tempered = torch.log_softmax(logits, -1)[pos, ids[0, len(prompt) :]].cpu()
            assert (tempered - torch.tensor(r.sampler_logprobs)).abs().max() > 1e-2


def test_same_tokens_and_logprobs_as_plain_generate_output_logits(tok):
    """The on-the-fly recorder equals log_softmax of HF's output_logits, same samples."""
    model = _model(tok, "qwen3")
    engine = HFGenerateEngine(model, tok)
    sampling = SamplingParams(n=1, temperature=0.7, top_p=0.95, max_new_tokens=16, seed=5)
    r = engine.generate(CHATS[:1], sampling).rollouts[0]
    prompt = engine.prompt_ids(CHATS[0])
    torch.manual_seed(5)
    out = model.generate(
        input_ids=torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=True,
        temperature=0.7,
        top_p=0.95,
        top_k=0,
        max_new_tokens=16,
        eos_token_id=EOS,
        pad_token_id=tok.pad_token_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    n = len(r.response_ids)
    assert tokens[:n] == r.response_ids
    raw = torch.stack(out.logits, 1)[0].float().log_softmax(-1)
    ref = raw[torch.arange(n), torch.tensor(tokens[:n])]
    torch.testing.assert_close(torch.tensor(r.sampler_logprobs), ref, atol=1e-6, rtol=0)


def test_model_generation_config_is_ignored(tok):
    """A model-level top_k / repetition penalty must not change what the engine samples."""
    model = _model(tok)
    sampling = SamplingParams(n=2, max_new_tokens=12, seed=2)
    before = HFGenerateEngine(model, tok).generate(CHATS, sampling)
    saved = model.generation_config
    model.generation_config.top_k = 3
    model.generation_config.repetition_penalty = 3.0
    after = HFGenerateEngine(model, tok).generate(CHATS, sampling)
    assert model.generation_config is saved and model.generation_config.top_k == 3
    assert [r.response_ids for r in before.rollouts] == [r.response_ids for r in after.rollouts]


# --------------------------------------------------------------------------------------------------
# RNG, modes, grad


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_reproducible_and_global_rng_untouched(tok, device):
    engine = HFGenerateEngine(_model(tok, device=device), tok, batch_size=2)
    sampling = SamplingParams(n=3, max_new_tokens=10, seed=123)
    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state() if device == "cuda" else None
    a = engine.generate(CHATS, sampling)
    b = engine.generate(CHATS, sampling)
    assert torch.equal(torch.get_rng_state(), cpu_state)
    if cuda_state is not None:
        assert torch.equal(torch.cuda.get_rng_state(), cuda_state)
    assert [r.response_ids for r in a.rollouts] == [r.response_ids for r in b.rollouts]
    assert [r.sampler_logprobs for r in a.rollouts] == [r.sampler_logprobs for r in b.rollouts]
    c = engine.generate(CHATS, SamplingParams(n=3, max_new_tokens=10, seed=124))
    assert [r.response_ids for r in a.rollouts] != [r.response_ids for r in c.rollouts]


def test_unseeded_uses_global_rng(tok):
    engine = HFGenerateEngine(_model(tok), tok)
    sampling = SamplingParams(n=2, max_new_tokens=8)
    torch.manual_seed(7)
    a = engine.generate(CHATS, sampling)
    state = torch.get_rng_state()
    b = engine.generate(CHATS, sampling)
    assert not torch.equal(torch.get_rng_state(), state)  # advanced
    torch.manual_seed(7)
    c = engine.generate(CHATS, sampling)
    assert [r.response_ids for r in a.rollouts] == [r.response_ids for r in c.rollouts]
    assert [r.response_ids for r in a.rollouts] != [r.response_ids for r in b.rollouts]


def test_eval_mode_during_generation_and_modes_restored(tok):
    model = _model(tok)
    model.train()
    model.model.layers[0].eval()  # a mixed state must come back as it was
    before = {name: m.training for name, m in model.named_modules()}
    seen: list[bool] = []
    model.model.layers[1].register_forward_pre_hook(lambda m, _i: seen.append(m.training))
    engine = HFGenerateEngine(model, tok)
    assert torch.is_grad_enabled()
    batch = engine.generate(CHATS[:2], SamplingParams(n=2, max_new_tokens=6, seed=0))
    assert seen and not any(seen)
    assert {name: m.training for name, m in model.named_modules()} == before
    assert torch.is_grad_enabled()
    assert all(p.grad is None for p in model.parameters())
    for r in batch.rollouts:  # plain Python values: no tensors, so no graph can be kept
        assert all(type(t) is int for t in r.response_ids)
        assert all(type(x) is float for x in r.sampler_logprobs or [])
    model.eval()
    engine.generate(CHATS[:1], SamplingParams(max_new_tokens=3, seed=0))
    assert not any(m.training for m in model.modules())


def test_no_grad_inside_generation(tok):
    model = _model(tok)
    grad_modes: list[bool] = []
    model.model.layers[0].register_forward_pre_hook(
        lambda _m, _i: grad_modes.append(torch.is_grad_enabled())
    )
    HFGenerateEngine(model, tok).generate(CHATS[:1], SamplingParams(max_new_tokens=4, seed=0))
    assert grad_modes and not any(grad_modes)


# --------------------------------------------------------------------------------------------------
# prompt truncation


def test_prompt_truncation_modes(tok):
    model = _model(tok, "llama")
    lengths = [len(HFGenerateEngine(model, tok).prompt_ids(c)) for c in CHATS]
    limit = sorted(lengths)[1]  # one prompt is longer than the limit
    long_i = lengths.index(max(lengths))
    sampling = SamplingParams(n=2, max_new_tokens=6)

    left = HFGenerateEngine(model, tok, max_prompt_length=limit, greedy=True)
    batch = left.generate(CHATS, sampling)
    assert batch.num_truncated_prompts == 1 and batch.num_skipped_prompts == 0
    assert [r.prompt_index for r in batch.rollouts] == [0, 0, 1, 1, 2, 2]
    kept_ids = left.prompt_ids(CHATS[long_i])[-limit:]  # the last tokens are kept
    expect, _ = _manual_greedy(model, kept_ids, 6, left.stop_token_ids)
    assert batch.rollouts[2 * long_i].response_ids == expect

    skip = HFGenerateEngine(model, tok, max_prompt_length=limit, prompt_truncation="skip")
    batch = skip.generate(CHATS, SamplingParams(n=2, max_new_tokens=6, seed=0))
    assert batch.num_skipped_prompts == 1 and batch.num_truncated_prompts == 0
    assert batch.messages == CHATS
    assert [r.prompt_index for r in batch.rollouts] == [
        i for i in range(3) if i != long_i for _ in range(2)
    ]
    assert batch.row_messages() == [CHATS[r.prompt_index] for r in batch.rollouts]
    tiny_limit = HFGenerateEngine(model, tok, max_prompt_length=1, prompt_truncation="skip")
    batch = tiny_limit.generate(CHATS, sampling)
    assert batch.rollouts == [] and batch.num_skipped_prompts == 3

    error = HFGenerateEngine(model, tok, max_prompt_length=limit, prompt_truncation="error")
    with pytest.raises(ValueError, match=rf"prompt {long_i} has {lengths[long_i]} tokens"):
        error.generate(CHATS, sampling)
    # at the limit exactly: fine
    ok = HFGenerateEngine(model, tok, max_prompt_length=max(lengths), prompt_truncation="error")
    assert ok.generate(CHATS, sampling).num_truncated_prompts == 0


# --------------------------------------------------------------------------------------------------
# argument errors


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 0},
        {"n": 1.5},
        {"temperature": 0.0},
        {"temperature": -1.0},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"max_new_tokens": 0},
        {"max_new_tokens": 2.0},
    ],
)
def test_bad_sampling_params(kwargs):
    with pytest.raises(ValueError, match="SamplingParams"):
        SamplingParams(**kwargs)


def test_bad_engine_arguments(tok):
    model = _model(tok)
    for kwargs in (
        {"batch_size": 0},
        {"batch_size": True},
        {"max_prompt_length": 0},
        {"prompt_truncation": "right"},
        {"greedy": 1},
        {"eos_token_ids": []},
    ):
        with pytest.raises(ValueError):
            HFGenerateEngine(model, tok, **kwargs)
    with pytest.raises(TypeError, match="generate"):
        HFGenerateEngine(torch.nn.Linear(2, 2), tok)  # type: ignore[arg-type]
    engine = HFGenerateEngine(model, tok)
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.generate(CHATS, {"n": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sequence of chats"):
        engine.generate("hello", SamplingParams())  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# greedy, stop tokens


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_greedy_equals_manual_argmax(tok, kind):
    model = _model(tok, kind, eos_bias=5.0)
    engine = HFGenerateEngine(model, tok, greedy=True)
    batch = engine.generate(CHATS, SamplingParams(n=2, temperature=0.3, max_new_tokens=10))
    for r in batch.rollouts:
        expect, lps = _manual_greedy(
            model, engine.prompt_ids(CHATS[r.prompt_index]), 10, engine.stop_token_ids
        )
        assert r.response_ids == expect
        assert r.finished == (expect[-1] in engine.stop_token_ids)
        torch.testing.assert_close(torch.tensor(r.sampler_logprobs), torch.tensor(lps), atol=1e-5,
                                   rtol=0)
    assert batch.rollouts[0].response_ids == batch.rollouts[1].response_ids


def test_default_stop_tokens(tok):
    model = _model(tok, eos_bias=0)
    assert default_stop_token_ids(tok, model) == (EOS,)
    other = tiny_tokenizer()
    other.eos_token = "<|endoftext|>"  # a base model's EOS; the template ends turns with im_end
    assert default_stop_token_ids(other) == (0, EOS)
    model.generation_config.eos_token_id = [EOS, 5]
    assert HFGenerateEngine(model, other).stop_token_ids == (0, EOS, 5)
    assert HFGenerateEngine(model, other, eos_token_ids=[7, 7, 9]).stop_token_ids == (7, 9)


def test_custom_stop_tokens_cut_at_the_first(tok):
    stop = tuple(range(4, 300))  # about 30 % of the vocabulary: responses stop early
    engine = HFGenerateEngine(_model(tok, eos_bias=0), tok, eos_token_ids=stop)
    batch = engine.generate(CHATS, SamplingParams(n=4, max_new_tokens=12, seed=1))
    for r in batch.rollouts:
        _check_rollout(r, stop, 12)
    assert sum(r.finished for r in batch.rollouts) >= 6


# --------------------------------------------------------------------------------------------------
# load_weights


def test_load_weights(tok):
    model = _model(tok, "llama", eos_bias=0)
    engine = HFGenerateEngine(model, tok, greedy=True)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    engine.load_weights(model.named_parameters())  # the live module: validated no-op
    assert engine.last_load_copied == 0
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs

    other = _model(tok, "llama", eos_bias=0, seed=1)
    sampling = SamplingParams(n=1, max_new_tokens=8)
    target = HFGenerateEngine(other, tok, greedy=True).generate(CHATS, sampling)
    assert engine.generate(CHATS, sampling).rollouts != target.rollouts
    engine.load_weights(other.state_dict().items())
    assert engine.last_load_copied > 0
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs  # copied in place
    for (n, p), (_, q) in zip(model.named_parameters(), other.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert engine.generate(CHATS, sampling).rollouts == target.rollouts

    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
    name, weight = next(iter(model.named_parameters()))
    with pytest.raises(ValueError, match="not parameters or buffers"):
        engine.load_weights([(name, torch.zeros_like(weight)), ("no.such.weight", weight)])
    with pytest.raises(ValueError, match="wrong shape"):
        engine.load_weights([(name, torch.zeros_like(weight)), (name, weight[:1])])
    for n, p in model.named_parameters():  # nothing copied when a check fails
        assert torch.equal(p, snapshot[n]), n


# --------------------------------------------------------------------------------------------------
# the real SmolLM2-135M-Instruct


@pytest.mark.slow
def test_smollm2_sampling_and_logprobs():
    from saopd.models.loading import load_causal_lm, load_tokenizer
    from saopd.models.smollm2 import smollm2_135m_instruct

    folder = smollm2_135m_instruct()
    model, smol_tok = load_causal_lm(folder), load_tokenizer(folder)
    engine = HFGenerateEngine(model, smol_tok)
    assert engine.stop_token_ids == (smol_tok.convert_tokens_to_ids("<|im_end|>"),)
    chats = [
        [{"role": "user", "content": "What is 2 + 3? Answer briefly."}],
        [{"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and "
                                     "then she sold half as many clips in May. How many clips "
                                     "did Natalia sell altogether in April and May?"}],
    ]
    sampling = SamplingParams(n=2, temperature=0.8, max_new_tokens=8, seed=0)
    batch = engine.generate(chats, sampling)
    assert [r.prompt_index for r in batch.rollouts] == [0, 0, 1, 1]
    for r in batch.rollouts:
        _check_rollout(r, engine.stop_token_ids, 8)
        ref = _teacher_forced(model, engine.prompt_ids(chats[r.prompt_index]), r.response_ids)
        # 30 fp32 layers, KV cache + left padding vs one full pass: ~1e-5 of float noise
        torch.testing.assert_close(torch.tensor(r.sampler_logprobs), ref, atol=1e-4, rtol=0)
    again = engine.generate(chats, sampling)
    assert [r.response_ids for r in batch.rollouts] == [r.response_ids for r in again.rollouts]


# --------------------------------------------------------------------------------------------------
# the lean decode loop against model.generate


def _tiny_qwen2(tok, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, pad_token_id=tok.pad_token_id,
                         eos_token_id=EOS, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen2"])
@pytest.mark.parametrize(("temperature", "top_p", "greedy"),
                         [(1.0, 1.0, False), (0.7, 0.9, False), (1.0, 1.0, True)])
def test_lean_decode_draws_the_same_samples_as_generate(tok, kind, temperature, top_p, greedy):
    """The lean loop gives exactly HF generate's tokens and raw log-probs for a fixed seed:
    padded batches (prompts of different lengths, n samples each), a single unpadded prompt,
    responses that stop early and ones cut at max_new_tokens."""
    model = _tiny_qwen2(tok) if kind == "qwen2" else _model(tok, kind)
    lean = HFGenerateEngine(model, tok, greedy=greedy, batch_size=2)
    plain = HFGenerateEngine(model, tok, greedy=greedy, batch_size=2, lean_decode=False)
    assert lean.uses_lean_decode() and not plain.uses_lean_decode()
    finished = []
    for chats, n in ((CHATS, 3), (CHATS[:1], 1)):
        sampling = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_new_tokens=12,
                                  seed=11)
        a, b = lean.generate(chats, sampling), plain.generate(chats, sampling)
        assert [r.response_ids for r in a.rollouts] == [r.response_ids for r in b.rollouts]
        assert [r.sampler_logprobs for r in a.rollouts] == [r.sampler_logprobs for r in b.rollouts]
        assert [r.finished for r in a.rollouts] == [r.finished for r in b.rollouts]
        finished += [r.finished for r in a.rollouts]
    assert kind == "qwen2" or greedy or any(finished)  # stops mid-batch are covered


def test_lean_decode_only_for_checked_model_families(tok):
    """Models outside LEAN_DECODE_MODEL_TYPES sample through model.generate."""
    model = _model(tok)
    engine = HFGenerateEngine(model, tok)
    assert engine.uses_lean_decode()
    model.config.model_type = "some_other_family"
    try:
        assert not engine.uses_lean_decode()
    finally:
        model.config.model_type = "qwen3"


# --------------------------------------------------------------------------------------------------
# static KV cache + compiled decode step (rollout.static_cache)


@pytest.mark.parametrize("backend", [None, "eager"])
def test_static_cache_samples_as_the_default_path(tok, backend):
    """The static-cache engine (transformers' StaticCache through generate; its decode step
    compiled when a backend is given, traced by dynamo with ``eager``) gives the default lean
    loop's greedy tokens, and for a fixed seed generate's sampled tokens, and raw log-probs equal
    to a teacher-forced log-softmax of the same model: padded batches, rows that stop early."""
    model = _model(tok, "qwen3")
    static = HFGenerateEngine(model, tok, batch_size=2, static_cache=True, compile_backend=backend)
    assert not static.uses_lean_decode()
    greedy_static = HFGenerateEngine(model, tok, batch_size=2, greedy=True, static_cache=True,
                                     compile_backend=backend)
    greedy_lean = HFGenerateEngine(model, tok, batch_size=2, greedy=True)
    sampling = SamplingParams(n=2, max_new_tokens=12, seed=3)
    a, b = greedy_static.generate(CHATS, sampling), greedy_lean.generate(CHATS, sampling)
    assert [r.response_ids for r in a.rollouts] == [r.response_ids for r in b.rollouts]
    # generate took its compiled decode step (transformers keeps it on the model) only if asked
    assert hasattr(model, "_compiled_call") == (backend is not None)
    plain = HFGenerateEngine(model, tok, batch_size=2, lean_decode=False)
    sampled = SamplingParams(n=3, temperature=0.8, top_p=0.95, max_new_tokens=12, seed=11)
    s, p = static.generate(CHATS, sampled), plain.generate(CHATS, sampled)
    assert [r.response_ids for r in s.rollouts] == [r.response_ids for r in p.rollouts]
    assert any(r.finished for r in s.rollouts) and any(len(r.response_ids) > 1
                                                       for r in s.rollouts)
    for r in [*a.rollouts, *s.rollouts]:
        ref = _teacher_forced(model, static.prompt_ids(CHATS[r.prompt_index]), r.response_ids)
        assert_float_close(torch.tensor(r.sampler_logprobs), ref, ulps=64)


def test_static_cache_is_sized_in_rounded_steps_and_refuses_inverse_cdf(tok):
    """The cache length is prompt width + new tokens rounded up to STATIC_CACHE_ROUND (steps of
    other prompt widths reuse one shape); the option is refused with the inverse-CDF sampler."""
    from saopd.config.rollout import HFRolloutConfig
    from saopd.rollout.hf import STATIC_CACHE_ROUND

    engine = HFGenerateEngine(_model(tok), tok, static_cache=True)
    sampling = SamplingParams(max_new_tokens=12)
    for length, expected in ((13, STATIC_CACHE_ROUND), (STATIC_CACHE_ROUND, STATIC_CACHE_ROUND),
                             (STATIC_CACHE_ROUND + 1, 2 * STATIC_CACHE_ROUND)):
        config = engine._generation_config(sampling, length)
        assert config.cache_implementation == "static" and config.max_cache_len == expected
    off = HFGenerateEngine(_model(tok), tok)._generation_config(sampling, 13)
    assert off.cache_implementation is None
    with pytest.raises(ValueError, match="multinomial"):
        HFGenerateEngine(_model(tok), tok, static_cache=True, sampler="inverse_cdf")
    with pytest.raises(ValueError, match="multinomial"):
        HFRolloutConfig(static_cache=True, sampler="inverse_cdf")
    assert HFRolloutConfig().static_cache is False
