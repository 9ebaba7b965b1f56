"""saopd's scratch folders for vLLM (weight-sync shards, model copies): made with an owner
record, removed by the next run or server once their owner is dead.

A trainer or server killed with ``SIGKILL`` never runs its ``atexit`` clean-up, and its folder
(hundreds of MB to GB of shards, in RAM when it is under ``/dev/shm``) would stay forever.
:func:`owned_dir` writes, beside the folder's content, an owner record
(:data:`OWNER_FILE`: host, boot id, PID namespace, pid and the process's start time); every
``rollout=vllm_server`` run, ``rollout=vllm`` engine and ``saopd-serve`` server calls
:func:`remove_stale_dirs` on the parent it uses before making its own folder, which removes the
folders (of :data:`SCRATCH_PREFIXES`, owned by this user) whose owner is certainly dead: same
host and, either another boot, or the same PID namespace and no process with that pid and start
time. A folder whose owner cannot be judged (another host on a shared file system, another PID
namespace on a shared ``/dev/shm``, no or an unreadable record) is kept.

The server side of the sync folders: :func:`check_sync_folder` (a folder a ``saopd-serve``
server may read: a direct child of its weights folder, named ``saopd-weights-*``, not a link).
Standard library only.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

__all__ = [
    "OWNER_FILE",
    "SCRATCH_PREFIXES",
    "SHM",
    "SYNC_PREFIX",
    "check_sync_folder",
    "owned_dir",
    "owner_alive",
    "owner_record",
    "remove_stale_dirs",
    "shm_dir",
]

log = logging.getLogger(__name__)

#: RAM-backed folder for model copies and sync shards, where the machine has one.
SHM = Path("/dev/shm")
#: The owner record in each scratch folder (JSON).
OWNER_FILE = ".saopd-owner.json"
#: The prefix of ``rollout=vllm_server``'s sync folders (the only folders a server reads).
SYNC_PREFIX = "saopd-weights-"
#: saopd's scratch folders that :func:`remove_stale_dirs` may remove: the server sync folders,
#: ``rollout=vllm``'s ``files``-transport shards and its model copies.
SCRATCH_PREFIXES = (SYNC_PREFIX, "saopd-vllm-sync-", "saopd-vllm-model-")


def shm_dir() -> Path | None:
    """:data:`SHM` when the machine has it, else None (the system's temporary folder)."""
    return SHM if SHM.is_dir() else None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22),
    None where it cannot be read (no such process, no ``/proc``)."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after the command name, which may hold spaces
    try:
        return int(fields[19])  # field 22; fields[0] is field 3
    except (IndexError, ValueError):
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def owner_record(pid: int | None = None) -> dict[str, Any]:
    """Who owns a folder made now by process ``pid`` (None = this process)."""
    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "boot": _read("/proc/sys/kernel/random/boot_id"),
            "pid_ns": _pid_namespace(), "pid": pid, "start": _start_ticks(pid)}


def owner_alive(record: Any) -> bool | None:
    """Whether the owner of ``record`` (:func:`owner_record`) still runs: False only when it is
    certainly dead (this host, and another boot, or this PID namespace and no process of that
    pid and start time); None when it cannot be told (another host or PID namespace, a
    malformed record)."""
    if not isinstance(record, dict) or record.get("host") != socket.gethostname():
        return None
    pid = record.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    boot = _read("/proc/sys/kernel/random/boot_id")
    if record.get("boot") and boot and record["boot"] != boot:
        return False  # every process of another boot is gone
    if record.get("pid_ns") != _pid_namespace():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    start = record.get("start")
    now = _start_ticks(pid)
    # a different start time: the pid was reused by a later process
    return start is None or now is None or start == now


def owned_dir(prefix: str, parent: str | Path | None) -> Path:
    """A new folder ``<parent>/<prefix>XXXXXXXX`` (``parent`` None = the system's temporary
    folder; created if missing) holding this process's owner record."""
    if parent is not None:
        Path(parent).mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    (folder / OWNER_FILE).write_text(json.dumps(owner_record()))
    return folder


def remove_stale_dirs(parent: str | Path | None,
                      prefixes: tuple[str, ...] = SCRATCH_PREFIXES) -> list[Path]:
    """Remove the folders of ``parent`` (None = the system's temporary folder) named with one of
    ``prefixes``, owned by this user, whose owner record says their process is dead
    (:func:`owner_alive` False); returns them. Everything else is left alone."""
    root = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    try:
        children = list(root.iterdir())
    except OSError:
        return []
    removed = []
    for child in children:
        if not child.name.startswith(prefixes) or child.is_symlink() or not child.is_dir():
            continue
        try:
            if child.stat().st_uid != os.getuid():
                continue
            record = json.loads((child / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if owner_alive(record) is False:
            shutil.rmtree(child, ignore_errors=True)
            if not child.exists():
                removed.append(child)
                log.info("removed %s: its owner (pid %s) is dead", child, record.get("pid"))
    return removed


def check_sync_folder(folder: str, root: str | Path) -> Path:
    """``folder`` resolved, when a server whose weights folder is ``root`` may read it: an
    existing folder (not a link) named ``saopd-weights-*`` directly under ``root``.
    ``ValueError`` naming both otherwise (any other path, ``..`` included)."""
    if not isinstance(folder, str) or not folder:
        raise ValueError(f"not a folder name: {folder!r}")
    base = Path(root).resolve()
    given = Path(folder)
    if not given.is_absolute() or given.is_symlink():
        raise ValueError(f"{folder!r} is not an absolute path to a folder (links refused)")
    path = given.resolve()
    if path.parent != base or not path.name.startswith(SYNC_PREFIX) or ".." in given.parts:
        raise ValueError(f"{folder!r} is not a {SYNC_PREFIX}* folder directly under this "
                         f"server's weights folder {str(base)!r} (saopd-serve --weights-dir; "
                         "rollout.weights_dir must name the same folder)")
    if not path.is_dir():
        raise ValueError(f"{folder!r} is not a folder")
    return path
