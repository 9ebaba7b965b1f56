"""Local network helpers of the tests: a free TCP port, a real MLflow tracking server."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.helpers.mlflow_store import sqlite_store


def free_port() -> int:
    """A TCP port nothing listens on now on 127.0.0.1 (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def tracking_server(folder: Path) -> Iterator[str]:
    """``mlflow server`` (:func:`saopd.runs.server.start_server`) on 127.0.0.1 over a fresh
    SQLite store and artifact folder in ``folder``; yields its URL, stops it on exit."""
    from saopd.runs.server import start_server, stop_server

    port = free_port()
    process = start_server(backend_store_uri=sqlite_store(folder / "mlflow.db"),
                           artifacts_destination=folder / "artifacts", port=port, workers=1,
                           log_file=folder / "server.log")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(process)


def is_loopback(ip: str) -> bool:
    """True for 127.0.0.0/8, ::1 and IPv4 loopback mapped into IPv6 (``::ffff:127.0.0.1``)."""
    import ipaddress

    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


class RecordListeners:
    """Hydra callback for tests: when the sweep ends (its Ray cluster still up), write the TCP
    listeners of this process and every process under it to ``path`` as JSON rows
    ``[address, port, process name]``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_multirun_end(self, config: object, **kwargs: object) -> None:
        import json

        import psutil

        me = psutil.Process()
        pids = {me.pid, *(p.pid for p in me.children(recursive=True))}
        rows = []
        for conn in psutil.net_connections("inet"):
            if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
                try:
                    name = psutil.Process(conn.pid).name()
                except psutil.Error:
                    name = "?"
                rows.append([conn.laddr.ip, conn.laddr.port, name])
        Path(self.path).write_text(json.dumps(rows))
