"""The environment a colocated vLLM engine starts in: each local rank's share of the CPUs on
vLLM's CPU backend (the KV cache's sizing: test_kv_cache.py; the launcher variables:
tests/rollout/test_registry.py; both ranks' engines on their own CPUs, for real:
tests/integration/vllm/test_vllm_ranks.py)."""

from __future__ import annotations

import os

import pytest
import torch

from saopd.vllm.runtime import colocated_environ, cpu_threads_bind, engine_environment


@pytest.mark.parametrize(("ranks", "cpus"), [(2, [0, 1]), (3, list(range(8))), (4, [5, 1, 7, 3]),
                                             (2, [2, 3, 3, 2, 9])])
def test_each_local_rank_gets_its_own_contiguous_share_of_the_cpus(ranks: int,
                                                                    cpus: list[int]) -> None:
    shares = [[int(c) for c in cpu_threads_bind(r, ranks, cpus).split(",")]
              for r in range(ranks)]
    assert [c for share in shares for c in share] == sorted(set(cpus))  # all, once, in order
    sizes = [len(share) for share in shares]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_the_shares_of_eight_cpus_over_three_ranks() -> None:
    assert [cpu_threads_bind(r, 3, range(8)) for r in range(3)] == ["0,1,2", "3,4,5", "6,7"]


def test_fewer_cpus_than_ranks_binds_nothing_and_bad_ranks_are_refused() -> None:
    assert cpu_threads_bind(3, 4, [0, 1]) == "nobind"
    with pytest.raises(ValueError, match="local rank 2 is not one of 2 local ranks"):
        cpu_threads_bind(2, 2, [0, 1])
    with pytest.raises(ValueError, match="no CPUs"):
        cpu_threads_bind(0, 1, [])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU backend's environment")
def test_a_cpu_engine_of_several_local_ranks_starts_bound_to_its_share(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7})
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert colocated_environ(1, 2)["VLLM_CPU_OMP_THREADS_BIND"] == "6,7"
    with engine_environment(0, 2):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "4,5"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ  # restored
    # one rank: vLLM's own default; the user's setting: kept
    assert "VLLM_CPU_OMP_THREADS_BIND" not in colocated_environ(0, 1)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in colocated_environ(1, 2)
