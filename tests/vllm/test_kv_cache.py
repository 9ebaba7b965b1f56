"""The KV-cache size of a vLLM engine on the CPU backend given no ``kv_cache_gb``
(saopd.vllm.runtime): the sizing rule, the memory figures it reads, and the glue that
applies it only on CPU. vLLM itself is faked (the real engine: tests/integration/vllm)."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

import saopd.vllm.runtime as runtime
from saopd.vllm.runtime import (
    ENGINE_RESERVE_BYTES,
    KV_BLOCK_TOKENS,
    KV_CACHE_SHARE,
    MemoryFigures,
    available_memory,
    cpu_kv_cache_bytes,
    kv_bytes_per_token,
    size_cpu_kv_cache,
)

GIB = 1 << 30


def test_room_for_every_sequence_when_the_memory_allows_it() -> None:
    # a tiny model: 1 KiB per token, 256 x 4096 tokens = 1 GiB, well inside 25% of 16 GiB
    size = size_cpu_kv_cache(available_bytes=16 * GIB, weight_bytes=GIB, bytes_per_token=1024,
                             max_model_len=4096, max_num_seqs=256, owner="rollout")
    assert size == 1024 * 4096 * 256


def test_the_share_of_the_free_memory_bounds_it() -> None:
    # Qwen3-1.7B in bf16: 2 x 28 layers x 8 KV heads x 128 x 2 bytes = 112 KiB per token
    per_token = kv_bytes_per_token(SimpleNamespace(
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        hidden_size=2048, dtype="bfloat16"))
    assert per_token == 114_688
    size = size_cpu_kv_cache(available_bytes=20 * GIB, weight_bytes=4 * GIB,
                             bytes_per_token=per_token, max_model_len=8192, max_num_seqs=256,
                             owner="teacher_scoring")
    assert size == int(KV_CACHE_SHARE * (20 * GIB - 4 * GIB - ENGINE_RESERVE_BYTES))
    assert size >= per_token * 8192  # one full sequence fits


def test_one_sequence_in_whole_blocks_is_the_least() -> None:
    # max_model_len 300 rounds up to 512 tokens, plus one block: 768 tokens
    size = size_cpu_kv_cache(available_bytes=16 * GIB, weight_bytes=0, bytes_per_token=100,
                             max_model_len=300, max_num_seqs=1, owner="rollout")
    assert size == 100 * (2 * KV_BLOCK_TOKENS + KV_BLOCK_TOKENS)


def test_an_engine_that_cannot_hold_one_sequence_is_refused_naming_the_options() -> None:
    # Qwen3-4B's native 262,144-token context on a 12 GiB machine: 36 GiB for one sequence
    with pytest.raises(ValueError) as info:
        size_cpu_kv_cache(available_bytes=8 * GIB, weight_bytes=8 * GIB, bytes_per_token=147_456,
                          max_model_len=262_144, max_num_seqs=256, owner="teacher_scoring",
                          total_bytes=12 * GIB, source="NUMA node0")
    msg = str(info.value)
    assert "no teacher_scoring.kv_cache_gb" in msg
    assert "teacher_scoring.max_model_len=262144" in msg
    assert "Set teacher_scoring.kv_cache_gb=<GiB>" in msg and "lower teacher_scoring" in msg
    assert "8.00 GiB available of 12.00 GiB, NUMA node0" in msg
    assert "the bound is 0.00 GiB" in msg


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_available_memory_takes_the_tightest_figure(tmp_path: Path) -> None:
    assert available_memory(tmp_path) is None  # nothing to read
    _write(tmp_path / "proc/meminfo", "MemTotal:       25000000 kB\n"
                                      "MemFree:        17000000 kB\n"
                                      "MemAvailable:   21000000 kB\n")
    assert available_memory(tmp_path) == MemoryFigures(21000000 * 1024, 25000000 * 1024,
                                                       "MemAvailable")
    node = tmp_path / "sys/devices/system/node/node0"
    _write(node / "cpulist", "0-1\n")
    _write(node / "meminfo", "Node 0 MemTotal:       12000000 kB\n"
                             "Node 0 MemFree:         5000000 kB\n"
                             "Node 0 Active(file):    2000000 kB\n"
                             "Node 0 Inactive(file):  1000000 kB\n"
                             "Node 0 SReclaimable:     400000 kB\n")
    # vLLM's rule for a node: free + file pages + reclaimable slab
    assert available_memory(tmp_path) == MemoryFigures(8400000 * 1024, 12000000 * 1024,
                                                       "NUMA node0")
    _write(tmp_path / "sys/fs/cgroup/memory/memory.limit_in_bytes", f"{6 * GIB}\n")
    _write(tmp_path / "sys/fs/cgroup/memory/memory.usage_in_bytes", f"{2 * GIB}\n")
    assert available_memory(tmp_path) == MemoryFigures(4 * GIB, 6 * GIB, "cgroup limit")
    # cgroup v1's "no limit" is a huge number, not a limit
    _write(tmp_path / "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
    assert available_memory(tmp_path).source == "NUMA node0"


def test_this_machine_has_figures() -> None:
    figures = available_memory()
    assert figures is not None and 0 < figures.available <= figures.total


@pytest.fixture
def fake_vllm(monkeypatch):
    """``vllm.platforms.current_platform`` answering ``is_cpu()`` as ``state["cpu"]``."""
    state = {"cpu": True}
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(is_cpu=lambda: state["cpu"])
    vllm = types.ModuleType("vllm")
    vllm.platforms = platforms
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    return state


def test_cpu_engines_are_sized_from_the_model_and_the_free_memory(
        fake_vllm, monkeypatch, tmp_path: Path, caplog) -> None:
    from saopd.models.tiny import tiny_qwen3, tiny_tokenizer

    tiny_qwen3(tiny_tokenizer(), layers=4).save_pretrained(tmp_path)  # float32, 1 KV head x 32
    monkeypatch.setattr(runtime, "available_memory",
                        lambda: MemoryFigures(8 * GIB, 12 * GIB, "NUMA node0"))
    with caplog.at_level(logging.INFO, logger="saopd.vllm.runtime"):
        size = cpu_kv_cache_bytes(str(tmp_path), dtype="float32", max_model_len=None,
                                  max_num_seqs=None, owner="teacher_scoring")
    per_token = 2 * 4 * 1 * 32 * 4
    assert size == per_token * 4096 * 256  # the model's 4096 positions x vLLM's 256 sequences
    assert "KV cache 1.000 GiB (8.00 GiB available of 12.00 GiB, NUMA node0" in caplog.text
    small = cpu_kv_cache_bytes(str(tmp_path), dtype="float32", max_model_len=512,
                               max_num_seqs=4, owner="rollout")
    assert small == per_token * 512 * 4 and small < size
    # an explicit VLLM_CPU_KVCACHE_SPACE (vLLM's own variable) and GPU engines: vLLM decides
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert cpu_kv_cache_bytes(str(tmp_path), dtype="float32", max_model_len=None,
                              max_num_seqs=None, owner="rollout") is None
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    fake_vllm["cpu"] = False
    assert cpu_kv_cache_bytes(str(tmp_path), dtype="float32", max_model_len=None,
                              max_num_seqs=None, owner="rollout") is None


def test_unreadable_memory_is_refused_naming_the_option(fake_vllm, monkeypatch) -> None:
    monkeypatch.setattr(runtime, "available_memory", lambda: None)
    with pytest.raises(ValueError, match=r"free memory cannot be read: set "
                                         r"rollout\.kv_cache_gb=<GiB>"):
        cpu_kv_cache_bytes("/nowhere", dtype="auto", max_model_len=None, max_num_seqs=None,
                           owner="rollout")
