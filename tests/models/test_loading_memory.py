"""Loading without extra host copies: a 0.6B Qwen3-shaped model (Qwen3-0.6B's config) built
or loaded through saopd's loading path peaks at <= 1.5x its own bytes of host memory, measured
as the growth of a fresh process's high-water RSS over its RSS before (torch storages are
invisible to tracemalloc; the high-water mark is reset there through /proc/self/clear_refs).
And where a run loads its models (:func:`saopd.models.factory.load_device`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from saopd.config.run import TrainerConfig
from saopd.models.factory import load_device
from tests.conftest import REPO

MEASURE = r"""
import json, sys
import torch
from transformers import Qwen3Config
from saopd.models.loading import init_causal_lm, load_causal_lm

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

def peak():
    return status("VmHWM")

# the high-water mark from here on: the imports' peak is forgotten (it can stand above the
# current RSS when the kernel has dropped cold library pages since, which hid part of the growth)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")

mode, dtype, folder = sys.argv[1], sys.argv[2], sys.argv[3]
config = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                     num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                     head_dim=128, tie_word_embeddings=True)
base = status("VmRSS")
if mode == "init":
    model = init_causal_lm(config, dtype=dtype)
else:
    model = load_causal_lm(folder, dtype=dtype)
touched = sum(float(p.float().sum()) for p in model.parameters())  # every page read once
grown = peak() - base
result = {"bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
          "grown": grown, "dtype": str(next(model.parameters()).dtype),
          "finite": touched == touched}
if mode == "init" and folder:  # after measuring: a bfloat16 copy for the load to read
    model = model.to(torch.bfloat16)
    model.save_pretrained(folder)
    result["saved_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps(result))
"""


def _measure(mode: str, dtype: str, folder: str = "") -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", MEASURE, mode, dtype, folder], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_random_init_and_folder_load_peak_below_one_and_a_half_model_bytes(tmp_path):
    folder = tmp_path / "q06"
    built = _measure("init", "float32", str(folder))  # then saved in bfloat16 to ``folder``
    assert built["dtype"] == "torch.float32" and built["finite"]
    assert 2.3e9 < built["bytes"] < 2.5e9  # 0.6B parameters in float32
    # every parameter allocated once in its final dtype (a float32 build cast to bfloat16
    # afterwards peaks at ~2.5x the bfloat16 bytes)
    assert 0.9 * built["bytes"] <= built["grown"] <= 1.5 * built["bytes"]
    assert (folder / "config.json").is_file()
    loaded = _measure("load", "bfloat16", str(folder))
    assert loaded["dtype"] == "torch.bfloat16" and loaded["bytes"] == built["saved_bytes"]
    assert loaded["bytes"] * 2 == built["bytes"]
    assert loaded["finite"]
    assert 0.9 * loaded["bytes"] <= loaded["grown"] <= 1.5 * loaded["bytes"]


def test_load_device_follows_the_trainer(monkeypatch):
    """The run's GPU for one-process and DDP GPU runs, None on CPU and without CUDA, the meta
    device under FSDP."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    gpu = TrainerConfig(accelerator="gpu", precision="bf16-mixed")
    cpu = TrainerConfig()
    if not torch.cuda.is_available():
        assert load_device(gpu) is None  # no CUDA: the CPU, as before
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert load_device(cpu) is None
    assert load_device(gpu) == torch.device("cuda", 0)
    # FSDP: built on the meta device, filled shard by shard after sharding (test_meta_init.py)
    assert load_device(TrainerConfig(accelerator="gpu", strategy="fsdp", devices=2)) == \
        torch.device("meta")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert load_device(TrainerConfig(accelerator="gpu", strategy="ddp", devices=2)) == \
        torch.device("cuda", 1)
    assert load_device(TrainerConfig(accelerator="gpu", strategy="ddp", devices=[2, 3])) == \
        torch.device("cuda", 3)
