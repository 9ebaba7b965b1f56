"""FSDP's meta-device initialisation (:func:`saopd.models.sharding.materialize_sharded`) over two
gloo ranks: models built on the meta device, sharded, then filled shard by shard from rank 0's
build hold exactly the weights, buffers and ties of the model built whole on one CPU process
(tiny random student and teacher, a pretrained folder pruned, ``init_causal_lm`` with a seed),
and a meta model whose layout differs from rank 0's build is refused on both ranks."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from saopd.config.model import ModelConfig
from saopd.config.run import TrainerConfig
from saopd.models.factory import build_model, builds_on_meta, load_device
from saopd.models.loading import init_causal_lm
from saopd.models.sharding import (
    defer_weights,
    is_meta,
    materialize_sharded,
    shard_model,
    tied_pairs,
)
from saopd.models.tiny import tiny_qwen3, tiny_tokenizer


def _configs(folder: Path) -> dict[str, ModelConfig]:
    return {
        "student": ModelConfig(tiny="qwen3", tiny_layers=2, tiny_hidden=64, seed=3),
        "teacher": ModelConfig(tiny="llama", tiny_layers=3, tiny_hidden=64, seed=7),
        "folder": ModelConfig(name_or_path=str(folder), prune_keep=[0, 2]),
    }


def _qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                       tie_word_embeddings=False)


def _full(model: torch.nn.Module) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # gathered whole on every rank (cpu_offload would keep it on rank 0 only); on the CPU here
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    return {"state": state, "buffers": buffers, "tied": tied_pairs(model),
            "dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def _worker(rank: int, init: str, folder: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2,))
        results = {}
        for name, cfg in _configs(Path(folder)).items():
            model, _ = build_model(cfg, device="meta")
            assert is_meta(model)
            shard_model(model, mesh, frozen=name == "teacher")
            materialize_sharded(model, torch.device("cpu"))
            assert not is_meta(model)
            results[name] = _full(model)
        config = _qwen3_config()
        model = defer_weights(init_causal_lm(config, dtype="bfloat16", device="meta"),
                              functools.partial(init_causal_lm, config, dtype="bfloat16", seed=5))
        shard_model(model, mesh)
        results["init"] = _full(materialize_sharded(model, torch.device("cpu")))
        # a meta model of another width than rank 0's build: refused on both ranks
        tokenizer = tiny_tokenizer()
        with torch.device("meta"):
            wrong = tiny_qwen3(tokenizer, hidden=32)
        defer_weights(wrong, functools.partial(tiny_qwen3, tokenizer, hidden=64))
        shard_model(wrong, mesh)
        try:
            materialize_sharded(wrong, torch.device("cpu"))
        except ValueError as err:
            results["mismatch"] = str(err)
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_meta_built_sharded_models_equal_the_models_built_whole(tmp_path: Path) -> None:
    folder = tmp_path / "pretrained"
    tiny_qwen3(tiny_tokenizer(), layers=3, hidden=64, seed=11).save_pretrained(folder)
    mp.spawn(_worker, args=(f"file://{tmp_path / 'init'}", str(folder), str(tmp_path)),
             nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    whole = {name: build_model(cfg)[0] for name, cfg in _configs(folder).items()}
    whole["init"] = init_causal_lm(_qwen3_config(), dtype="bfloat16", seed=5)
    for name, model in whole.items():
        expected = model.state_dict()
        buffers = dict(model.named_buffers())
        assert buffers, name  # the rotary inv_freq (non-persistent) is among them
        for got in ranks:
            state = got[name]["state"]
            assert sorted(state) == sorted(expected), name
            for key, value in expected.items():
                assert state[key].dtype == value.dtype, (name, key)
                assert torch.equal(state[key], value), (name, key)
            assert sorted(got[name]["buffers"]) == sorted(buffers)
            for key, value in buffers.items():
                assert torch.equal(got[name]["buffers"][key], value), (name, key)
            assert got[name]["tied"] == tied_pairs(model), name  # tied embeddings stay tied
    assert ranks[0]["student"]["tied"] == [("lm_head.weight", "model.embed_tokens.weight")]
    assert ranks[0]["init"]["dtypes"] == ["torch.bfloat16"]
    assert len(whole["folder"].model.layers) == 2  # pruned from 3, on both paths
    for got in ranks:
        assert "does not match the built one" in got["mismatch"]
        assert "model.embed_tokens.weight" in got["mismatch"]


def test_meta_init_draws_nothing_and_fsdp_builds_on_meta(monkeypatch) -> None:
    """A meta ``init_causal_lm`` leaves the global RNG alone (a CPU one reseeds it); under
    FSDP the run's models are built on the meta device, except configs that cannot be."""
    before = torch.random.get_rng_state()
    model = init_causal_lm(_qwen3_config(), device="meta")
    assert is_meta(model) and torch.equal(torch.random.get_rng_state(), before)
    assert load_device(TrainerConfig(strategy="fsdp", devices=2)) == torch.device("meta")
    assert builds_on_meta(ModelConfig(tiny="qwen3"))
    assert builds_on_meta(ModelConfig(name_or_path="org/name", prune_every=2))
    assert not builds_on_meta(ModelConfig(name_or_path="/models/q.gguf"))
    assert not builds_on_meta(ModelConfig(tiny="qwen2_5_vl"))
    model, _ = build_model(ModelConfig(tiny="llama"), device="meta")
    assert is_meta(model)
    with pytest.raises(ValueError, match="meta device"):
        defer_weights(build_model(ModelConfig(tiny="llama"))[0], lambda: None)
