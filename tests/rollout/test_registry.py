"""rollout=vllm wiring that needs no vLLM: the weight-bucket gatherer (plain tensors and 2-rank
FSDP2-style DTensor shards over gloo), name canonicalisation, the config group and its range
checks, the importance-ratio default per engine, the factory's refusals, and the clear error
when vllm is not installed. The engine itself is tested on real vLLM in tests/integration/vllm/ (not
tests/vllm/: with tests/ on sys.path, a folder named vllm there would import as a namespace
package called vllm where the real one is missing)."""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from saopd.config import to_train_config
from saopd.rollout.registry import build_engine, num_training_processes
from saopd.rollout.vllm import canonical_weight_name, iter_full_tensor_buckets
from tests.conftest import compose_train

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_saopd_rollout_vllm_imports_without_vllm() -> None:
    import saopd.rollout.vllm as module

    assert module.VLLMEngine.holds_weights


def test_buckets_respect_the_size_and_keep_order() -> None:
    tensors = [(f"w{i}", torch.full((n,), float(i))) for i, n in enumerate([10, 10, 30, 5, 5])]
    buckets = list(iter_full_tensor_buckets(tensors, bucket_bytes=80))  # 20 float32
    assert [[n for n, _ in b] for b in buckets] == [["w0", "w1"], ["w2"], ["w3", "w4"]]
    flat = [t for b in buckets for _, t in b]
    assert all(a.data_ptr() == b.data_ptr() for a, (_, b) in zip(flat, tensors, strict=True))
    with pytest.raises(ValueError, match="bucket_bytes must be an int >= 1"):
        list(iter_full_tensor_buckets(tensors, bucket_bytes=0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dtensor_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        full = {"a": torch.arange(12.0).reshape(6, 2), "b": torch.arange(8.0) * -1,
                "c": torch.ones(4, 3)}
        named = [(n, distribute_tensor(t, mesh, [Shard(0)])) for n, t in full.items()]
        assert all(t.to_local().shape[0] == full[n].shape[0] // 2 for n, t in named)
        got = [[(n, t.clone()) for n, t in b]
               for b in iter_full_tensor_buckets(named, bucket_bytes=64)]
        if rank == 0:
            torch.save(got, out)
    finally:
        dist.destroy_process_group()


def test_dtensor_shards_are_gathered_to_full_tensors_per_bucket(tmp_path: Path) -> None:
    out = str(tmp_path / "got.pt")
    mp.start_processes(_dtensor_worker, args=(_free_port(), out), nprocs=2, join=True,
                       start_method="spawn")
    got = torch.load(out)
    assert [[n for n, _ in b] for b in got] == [["a"], ["b"], ["c"]]  # 48, 32 (+48 > 64), 48 B
    assert torch.equal(got[0][0][1], torch.arange(12.0).reshape(6, 2))
    assert torch.equal(got[1][0][1], torch.arange(8.0) * -1)
    assert torch.equal(got[2][0][1], torch.ones(4, 3))


def test_canonical_weight_names() -> None:
    assert canonical_weight_name("model._orig_mod.layers.0.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    assert canonical_weight_name(
        "model.layers.1._checkpoint_wrapped_module.self_attn.q_proj.weight") == \
        "model.layers.1.self_attn.q_proj.weight"
    assert canonical_weight_name("lm_head.weight") == "lm_head.weight"


def test_vllm_config_group_and_importance_ratio_default(tmp_path: Path) -> None:
    hf = to_train_config(compose_train(tmp_path, "experiment=tiny"))
    assert hf.rollout.engine == "hf" and hf.objective["importance_ratio_cap"] is None
    vl = to_train_config(compose_train(tmp_path, "experiment=tiny", "rollout=vllm"))
    assert vl.rollout.engine == "vllm" and vl.objective["importance_ratio_cap"] == 5.0
    assert (vl.rollout.n, vl.rollout.max_new_tokens) == (2, 12)  # the experiment's values stay
    ex = to_train_config(compose_train(tmp_path, "experiment=tiny", "rollout=vllm",
                                       "objective=exopd"))
    assert ex.objective["importance_ratio_cap"] == 5.0
    off = to_train_config(compose_train(tmp_path, "experiment=tiny", "rollout=vllm",
                                        "objective.importance_ratio_cap=null"))
    assert off.objective["importance_ratio_cap"] is None
    kl = to_train_config(compose_train(tmp_path, "experiment=tiny", "rollout=vllm",
                                       "objective=full_kl"))
    assert "importance_ratio_cap" not in kl.objective


@pytest.mark.parametrize(("override", "match"), [
    ("rollout.engine=sglang", r"rollout.engine is 'vllm' in conf/rollout/vllm.yaml, got 'sglang': .*rollout=<engine>"),
    ("rollout.sleep_level=3", r"rollout.sleep_level must be one of \[1, 2\], got 3"),
    ("rollout.gpu_memory_utilization=0", r"rollout.gpu_memory_utilization must be a number in \(0.0, 1.0\]"),
    ("rollout.gpu_memory_utilization=1.5", r"rollout.gpu_memory_utilization must be a number in \(0.0, 1.0\], got 1.5"),
    ("rollout.kv_cache_gb=-1", r"rollout.kv_cache_gb must be null or a number > 0.0"),
    ("rollout.weight_bucket_mb=0", r"rollout.weight_bucket_mb must be an int >= 1, got 0"),
    ("rollout.tensor_parallel_size=0", r"rollout.tensor_parallel_size must be an int >= 1"),
    ("rollout.sync_transport=nccl", r"rollout.sync_transport must be one of"),
    ("rollout.dtype=int8", r"rollout.dtype must be one of"),
    ("rollout.importance_ratio_cap=0", r"rollout.importance_ratio_cap must be > 0"),
])
def test_bad_vllm_values_name_the_key(override: str, match: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=match):
        to_train_config(compose_train(tmp_path, "experiment=tiny", "rollout=vllm", override))


def test_factory_refuses_several_processes(tmp_path: Path, tiny_tok) -> None:
    from saopd.models.tiny import tiny_qwen3

    conf = to_train_config(compose_train(tmp_path, "experiment=tiny", "rollout=vllm")).rollout
    model = tiny_qwen3(tiny_tok)
    with pytest.raises(ValueError, match=r"one training process only \(this run would start 2"):
        build_engine(conf, model, tiny_tok, devices=2)
    with pytest.raises(ValueError, match=r"start 4"):
        build_engine(conf, model, tiny_tok, devices=[0, 1], num_nodes=2)
    with pytest.raises(ValueError, match=r"rollout.max_images_per_prompt must be"):
        to_train_config(compose_train(tmp_path, "experiment=tiny", "rollout=vllm",
                                      "rollout.max_images_per_prompt=0"))
    assert num_training_processes("1") == 1 and num_training_processes([0, 1, 2]) == 3


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed here")
def test_missing_vllm_is_a_clear_user_error(make_cfg) -> None:
    from saopd.train import UserError, train

    cfg = make_cfg("experiment=tiny", "rollout=vllm", "steps=1", mlflow=False)
    with pytest.raises(UserError, match=r"rollout: rollout=vllm needs the vllm package.*"
                                        r"make setup-vllm"):
        train(cfg)
