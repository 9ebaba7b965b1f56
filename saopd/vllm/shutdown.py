"""Shutting a ``vllm.LLM`` down, the one way every engine of :mod:`saopd.vllm` does it.

:func:`shutdown_llm` stops the engine core (its own process, or the one running in this
process), then takes down as much of ``torch.distributed`` as the engine set up here, no more:

- ``"none"``: nothing (an engine core in its own process: the teacher's scoring engine, a
  colocated rollout engine by default);
- ``"all"``: vLLM's model-parallel state and its distributed environment (an in-process engine,
  which set both up in this process);
- ``"vllm_groups"``: only the groups vLLM built over the trainer's default process group (a
  tensor-parallel shard started with vLLM's external launcher: its model-parallel groups and its
  world group), leaving the trainer's default group alone, which vLLM's
  ``destroy_distributed_environment`` would destroy too. Another engine may then start in this
  process.

Every step is best effort: a failure to shut down never hides what the caller was doing.

The objects that own an engine, a thread pool or scratch folders (the colocated engine, the
teacher's engines and the server clients) close the same way: :class:`Closing` makes each a
context manager whose exit calls its ``close``, :func:`stop_pool` ends its thread pool and
:func:`remove_folder` removes a folder it created.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from concurrent.futures import Executor
from typing import Any, TypeVar

__all__ = ["TEARDOWNS", "Closing", "remove_folder", "shutdown_llm", "stop_pool"]

_C = TypeVar("_C", bound="Closing")

#: What :func:`shutdown_llm` may take down of ``torch.distributed`` (module docstring).
TEARDOWNS = ("none", "all", "vllm_groups")


def shutdown_llm(llm: Any, *, distributed: str = "none") -> None:
    """Shut the ``vllm.LLM`` ``llm`` down: its engine core, then what ``distributed`` (one of
    :data:`TEARDOWNS`) names of the process groups it set up here (module docstring).
    ``ValueError`` for another ``distributed``."""
    if distributed not in TEARDOWNS:
        raise ValueError(f"shutdown_llm: distributed must be one of {TEARDOWNS}, got "
                         f"{distributed!r}")
    core = getattr(llm.llm_engine, "engine_core", None)
    with contextlib.suppress(Exception):
        if core is not None:
            core.shutdown()
    if distributed == "none":
        return
    with contextlib.suppress(Exception):
        from vllm.distributed import parallel_state

        parallel_state.destroy_model_parallel()
        if distributed == "all":
            parallel_state.destroy_distributed_environment()
        else:
            world = getattr(parallel_state, "_WORLD", None)
            if world is not None:
                world.destroy()
                parallel_state._WORLD = None


class Closing:
    """A base for what must be closed: ``with obj:`` returns ``obj`` and calls ``obj.close()``
    on the way out, whatever happened inside."""

    def close(self) -> None:
        """Release what the object holds (overridden by every subclass)."""
        raise NotImplementedError

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def stop_pool(pool: Executor | None, *, wait: bool) -> None:
    """Shut the thread pool ``pool`` down (None: nothing to do). ``wait=True`` lets the calls
    already submitted finish first; ``wait=False`` returns at once and cancels the calls not yet
    started."""
    if pool is not None:
        pool.shutdown(wait=wait, cancel_futures=not wait)


def remove_folder(folder: str | os.PathLike | None) -> None:
    """Remove ``folder`` and everything in it, ignoring errors (None or a missing folder:
    nothing to do)."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
