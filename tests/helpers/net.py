"""Local network helpers of the tests: a free TCP port, a real MLflow tracking server."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    """A TCP port nothing listens on now on 127.0.0.1 (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def tracking_server(folder: Path) -> Iterator[str]:
    """``mlflow server`` (:func:`saopd.tracking_server.start_server`) on 127.0.0.1 over a fresh
    SQLite store and artifact folder in ``folder``; yields its URL, stops it on exit."""
    from saopd.tracking_server import start_server, stop_server

    port = free_port()
    process = start_server(backend_store_uri=f"sqlite:///{folder / 'mlflow.db'}",
                           artifacts_destination=folder / "artifacts", port=port, workers=1,
                           log_file=folder / "server.log")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(process)
