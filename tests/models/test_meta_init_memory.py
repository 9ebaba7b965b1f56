"""Host memory of FSDP's meta-device initialisation: two gloo ranks, one process each, load a
~0.22B Qwen3-shaped bfloat16 folder through :func:`saopd.models.factory.build_model` on the meta
device, shard it and fill their shards (:func:`saopd.models.sharding.materialize_sharded`).
Rank 1 never holds the whole model: its peak RSS growth stays well below the model's bytes (its
half of the shards plus one tensor in flight), where the CPU path (every rank loads the whole
model, then shards it) grows by at least the model's bytes on every rank. Rank 0 loads the whole
model once, for the broadcast. Peaks are the growth of each process's high-water RSS (reset
through /proc/self/clear_refs) over its RSS before building, as in test_loading_memory.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

SAVE = r"""
import sys
from transformers import Qwen3Config
from saopd.models.loading import init_causal_lm
from saopd.models.tiny import tiny_tokenizer

config = Qwen3Config(vocab_size=32000, hidden_size=1024, intermediate_size=3072,
                     num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=8,
                     head_dim=128, tie_word_embeddings=True)
init_causal_lm(config, dtype="bfloat16", seed=0).save_pretrained(sys.argv[1])
tiny_tokenizer().save_pretrained(sys.argv[1])
"""

MEASURE = r"""
import json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoTokenizer, Qwen3ForCausalLM  # imported before the baseline
from saopd.config.model import ModelConfig
from saopd.models.factory import build_model
from saopd.models.sharding import materialize_sharded, shard_model

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

mode, folder = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
mesh = init_device_mesh("cpu", (2,))
cfg = ModelConfig(name_or_path=folder, dtype="bfloat16")
dist.barrier()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS")
if mode == "meta":
    model, _ = build_model(cfg, device="meta")
    shard_model(model, mesh)
    materialize_sharded(model, torch.device("cpu"))
else:  # the CPU path: the whole model on every rank, then sharded
    model, _ = build_model(cfg)
    shard_model(model, mesh)
grown = status("VmHWM") - base
params = list(model.parameters())
local = sum(p.to_local().numel() * p.element_size() for p in params)
full = sum(p.numel() * p.element_size() for p in params)
dist.barrier()
dist.destroy_process_group()
print(json.dumps({"rank": rank, "grown": grown, "local": local, "bytes": full}))
"""


def _env(rank: int, port: int) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for key in ("LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    return {**env, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(mode: str, folder: Path) -> list[dict]:
    """Both ranks' ``{"rank", "grown", "local", "bytes"}`` for ``mode`` (``meta`` | ``cpu``)."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", MEASURE, mode, str(folder)], cwd=REPO,
                              env=_env(rank, port), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("q022") / "model"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", SAVE, str(path)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return path


@pytest.mark.slow
def test_non_zero_ranks_never_hold_the_whole_model(folder: Path) -> None:
    meta = measure("meta", folder)
    size = meta[0]["bytes"]
    assert 4.2e8 < size < 4.6e8  # ~0.22B parameters in bfloat16
    for rank in meta:
        assert rank["bytes"] == size and rank["local"] == pytest.approx(size / 2, rel=0.01)
    # rank 1: its shards (0.5x) and one tensor in flight, never the whole model
    assert 0.4 * size <= meta[1]["grown"] <= 0.8 * size, meta
    # rank 0: the whole model, loaded once for the broadcast, and its shards
    assert meta[0]["grown"] <= 1.8 * size, meta
    cpu = measure("cpu", folder)
    assert all(rank["grown"] >= 0.9 * size for rank in cpu), cpu  # every rank held it all
    assert meta[1]["grown"] < 0.8 * cpu[1]["grown"]
