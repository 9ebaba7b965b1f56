"""Tiny tokenizer and tiny random models for fast tests."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from saopd.models.tiny import (
    TINY_SPECIAL_TOKENS,
    tiny_corpus,
    tiny_llama,
    tiny_qwen3,
    tiny_tokenizer,
)

TEXTS = [
    "Alice has 12 apples.",
    "  two  spaces\tand a tab\n\nnew lines",
    "Ünïcödé café naïve — “quotes” 😀 数学 π ≈ 3.14159",
    "We compute 123 * 45 = 5535, so the answer is \\boxed{5535}.",
    "",
]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_tiny_tokenizer_specials_and_size(tok):
    assert 300 <= len(tok) <= 2048
    assert [tok.convert_tokens_to_ids(t) for t in TINY_SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token == "<|pad|>" and tok.pad_token_id == 3
    assert tok.bos_token is None and tok.bos_token_id is None
    # special tokens are single ids inside text, and no BOS/EOS is added automatically
    ids = tok("<|im_start|>user\nhi<|im_end|>")["input_ids"]
    assert ids[0] == 1 and ids[-1] == 2
    assert 1 not in ids[1:-1] and 2 not in ids[1:-1]


@pytest.mark.parametrize("text", TEXTS)
def test_tiny_tokenizer_round_trip(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert all(0 <= i < len(tok) for i in ids)


def test_tiny_tokenizer_chat_template(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    out = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert out == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    out = tok.apply_chat_template(msgs[1:], tokenize=False, add_generation_prompt=False)
    assert out == "<|im_start|>user\n2+2?<|im_end|>\n"


def test_tiny_tokenizer_is_deterministic_and_instances_are_independent(tok):
    other = tiny_tokenizer()
    assert other is not tok
    assert other.get_vocab() == tok.get_vocab()
    other.padding_side = "left"
    assert tok.padding_side == "right"
    assert tiny_corpus() == tiny_corpus() and tiny_corpus(seed=1) != tiny_corpus()


@pytest.mark.parametrize("factory", [tiny_qwen3, tiny_llama])
def test_tiny_models_sized_and_deterministic(tok, factory):
    state = torch.random.get_rng_state()
    a = factory(tok, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state), "global RNG must be untouched"
    b = factory(tok, seed=3)
    c = factory(tok, seed=4)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert any(
        not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters(), strict=True)
    )
    cfg = a.config
    assert cfg.vocab_size == len(tok)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (2, 64, 2)
    assert (cfg.num_key_value_heads, cfg.head_dim) == (1, 32)
    assert cfg.eos_token_id == tok.eos_token_id and cfg.pad_token_id == tok.pad_token_id
    assert not a.training
    assert next(a.parameters()).dtype == torch.float32
    x = torch.tensor([tok("Alice has 3 apples.")["input_ids"]])
    with torch.no_grad():
        logits = a(x).logits
    assert logits.shape == (1, x.shape[1], len(tok))
    assert torch.isfinite(logits).all()


def test_tiny_model_options_and_errors(tok):
    m = tiny_qwen3(tok, layers=3, hidden=32, heads=4, kv_heads=2, head_dim=16, vocab_size=704)
    assert m.config.num_hidden_layers == 3 and m.config.vocab_size == 704
    assert m.get_output_embeddings().weight.shape == (704, 32)
    with pytest.raises(ValueError, match="vocab_size=10"):
        tiny_qwen3(tok, vocab_size=10)
    with pytest.raises(ValueError, match="kv_heads"):
        tiny_llama(tok, heads=3, kv_heads=2)
    with pytest.raises(ValueError, match="layers"):
        tiny_qwen3(tok, layers=0)
