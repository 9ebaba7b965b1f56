"""An MLflow tracking server for studies with many writers (sweep jobs on several nodes).

    make mlflow-server                                      # 127.0.0.1:5000, the repository's store
    make mlflow-server MLFLOW_PORT=5001 MLFLOW_HOST=0.0.0.0 # reachable from the cluster's nodes
    python -m saopd.runs.server --backend-store-uri postgresql://user@db/mlflow
    saopd-train -m seed=0,1,2 hydra/launcher=slurm logger.tracking_uri=http://<host>:5000
    saopd-report --tracking-uri http://<host>:5000 -e testbed

Why a server. ``saopd-train`` logs to a SQLite file (``sqlite:///<repo>/mlflow.db``) by default,
and parallel jobs on one machine take turns through a file lock (:func:`saopd.runs.tracking.
store_lock`). SQLite is not safe with many writers on a shared (network) file system: its locks
rely on the file system's byte-range locks, which NFS and its kin implement loosely or not at
all, so jobs writing from several nodes can corrupt the database or fail with "database is
locked". A tracking server is then the only process that opens the store: the jobs send their
params, metrics and artifacts over HTTP (``logger.tracking_uri=http://<host>:<port>``).
Behind the server, SQLite is fine while the file is on the server's own disk; for a large study,
or a store on a shared file system, point ``--backend-store-uri`` at PostgreSQL or MySQL (their
SQLAlchemy drivers, e.g. ``psycopg2``, are not installed by saopd).

Artifacts (configs, token views, reports) go through the server too (``--serve-artifacts``) into
``--artifacts-destination`` (default ``<repo>/mlartifacts``), so a job on another node needs no
access to that folder. Experiments created before the server, in the local store, keep their
``file:`` artifact folders beside ``mlflow.db``, which jobs write directly: fine on a shared
file system, which a cluster's jobs have anyway for the code and data.

Which launchers need it. :class:`StoreCheck` (a Hydra callback of ``conf/train.yaml``) refuses,
before any job is submitted, a sweep whose launcher runs jobs on several nodes
(``hydra/launcher=slurm``, ``hydra/launcher=ray_cluster`` connected to a cluster's address)
while runs
log to a ``sqlite:`` store, and says what to do instead (:func:`sqlite_refusal`). Local
launchers (basic, joblib, ``slurm_local``, Ray on a local cluster) keep the SQLite default.

The server's address is bound to 127.0.0.1 unless ``--host`` says otherwise: MLflow's server
has no authentication by default, so open it to a cluster's network only (``--host 0.0.0.0``),
never to the internet; MLflow accepts requests addressed to localhost and private IPs, and
``--allowed-hosts`` adds host names (``node01:5000``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from saopd.paths import default_tracking_uri, repo_root
from saopd.runs.ui import experiment_url

__all__ = [
    "DEFAULT_PORT",
    "SERVER_DEFAULTS",
    "StoreCheck",
    "build_parser",
    "main",
    "multi_node_launcher",
    "port_taken",
    "server_command",
    "server_environment",
    "sqlite_refusal",
    "start_server",
    "stop_server",
    "wait_until_up",
]

DEFAULT_PORT = 5000
#: SQLAlchemy URI schemes MLflow's server accepts as a database store (``postgresql+psycopg2``
#: and the like match by their first part).
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


# ---- the server ---------------------------------------------------------------------------------

def server_command(*, backend_store_uri: str, artifacts_destination: str, host: str = "127.0.0.1",
                   port: int = DEFAULT_PORT, workers: int | None = None,
                   extra: Sequence[str] = ()) -> list[str]:
    """The ``mlflow server`` command line (run with this Python's ``mlflow`` module).

    Raises ``ValueError`` naming the argument for a store that is not a database URI, a port
    out of range or a worker count below 1.
    """
    scheme = backend_store_uri.split(":", 1)[0].split("+", 1)[0] if ":" in backend_store_uri \
        else ""
    if scheme not in DATABASE_SCHEMES:
        raise ValueError(
            f"--backend-store-uri {backend_store_uri!r} is not a database URI (sqlite:///<file>,"
            " postgresql://..., mysql://..., mssql://...); MLflow 3 refuses file stores")
    if not 1 <= port <= 65535:
        raise ValueError(f"--port must be in 1..65535, got {port}")
    if workers is not None and workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", host, "--port", str(port),
           "--backend-store-uri", backend_store_uri, "--serve-artifacts",
           "--artifacts-destination", artifacts_destination]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    return [*cmd, *extra]


#: MLflow server variables saopd sets where the environment does not (:func:`server_environment`)
SERVER_DEFAULTS = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def server_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment ``mlflow server`` runs in: ``environ`` (default ``os.environ``) with
    :data:`SERVER_DEFAULTS` for the variables it does not set.

    MLflow 3's server starts, besides uvicorn, a job runner with a Huey consumer process per job
    kind (GenAI scorers, prompt optimisation, trace roll-ups), each importing MLflow: measured
    here, a 1-worker server's start took 30.6 s of CPU in 10 processes with them and 8.2 s in 2
    without. saopd's runs never submit MLflow jobs, so its server runs without them; a user who
    wants them sets ``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true``, which is kept.
    """
    env = dict(os.environ if environ is None else environ)
    for key, value in SERVER_DEFAULTS.items():
        env.setdefault(key, value)
    return env


def port_taken(host: str, port: int) -> str | None:
    """Why a server cannot listen on ``host:port`` (``"Address already in use"``: another
    process listens there), None when it can.

    Binds a socket there and closes it at once, as the server would bind (``SO_REUSEADDR``: a
    port whose last connections are still closing counts as free)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            return err.strerror or str(err)
    return None


def _port_refusal(host: str, port: int, why: str) -> str:
    return (f"cannot listen on {host}:{port} ({why}): another process holds port {port} (find "
            f"it with `ss -ltnp 'sport = :{port}'`; another tracking server?); pick a free one "
            "with --port")


def wait_until_up(url: str, *, timeout_s: float = 120.0,
                  process: subprocess.Popen | None = None) -> None:
    """Poll ``<url>/health`` until the server answers 200.

    Raises ``RuntimeError`` if ``process`` (the server) exits first, and ``TimeoutError`` after
    ``timeout_s`` seconds, each naming the address.
    """
    deadline = time.monotonic() + timeout_s
    health = url.rstrip("/") + "/health"
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the MLflow server for {url} exited with status "
                               f"{process.returncode} before answering {health}")
        try:
            with urllib.request.urlopen(health, timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer from {health} within {timeout_s:g} s")
        time.sleep(0.5)


def start_server(*, backend_store_uri: str, artifacts_destination: str | Path,
                 host: str = "127.0.0.1", port: int = DEFAULT_PORT, workers: int | None = None,
                 log_file: Path | None = None, timeout_s: float = 120.0) -> subprocess.Popen:
    """Start ``mlflow server`` in the background and return it once it answers.

    Its output goes to ``log_file`` (else is discarded); its environment is
    :func:`server_environment`'s. The server runs in a process group of
    its own (``mlflow server`` starts uvicorn and its workers): the caller stops
    them all with :func:`stop_server`; a server that fails to start is stopped and the error
    raised. A port
    another process listens on raises ``OSError`` naming it before anything starts (else the
    other process's ``/health`` would pass for this server's).
    """
    cmd = server_command(backend_store_uri=backend_store_uri,
                         artifacts_destination=str(artifacts_destination), host=host,
                         port=port, workers=workers)
    why = port_taken(host, port)
    if why is not None:
        raise OSError(_port_refusal(host, port, why))
    out = open(log_file, "wb") if log_file is not None else subprocess.DEVNULL  # noqa: SIM115
    try:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True, env=server_environment())
    finally:
        if log_file is not None:
            out.close()
    try:
        wait_until_up(f"http://{_connect_host(host)}:{port}", timeout_s=timeout_s,
                      process=process)
    except BaseException:
        stop_server(process)
        raise
    return process


def stop_server(process: subprocess.Popen, *, kill: bool = False, timeout_s: float = 30.0
                ) -> None:
    """Stop a server of :func:`start_server` and every process it started.

    ``SIGTERM`` to its process group (``kill``: ``SIGKILL``, as a crash would end it); once the
    server has exited, or after ``timeout_s`` seconds, ``SIGKILL`` to what is left of the group
    (signalling only ``mlflow server`` left uvicorn serving, and the job runner's consumers
    running where job execution is on)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL if kill else signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=timeout_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=timeout_s)


def _connect_host(host: str) -> str:
    """The address a client on this machine connects to for a server bound to ``host``."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m saopd.runs.server``."""
    root = repo_root()
    p = argparse.ArgumentParser(
        prog="python -m saopd.runs.server",
        description="Start an MLflow tracking server for saopd's runs (many writers: sweep jobs "
                    "on several nodes log through it with logger.tracking_uri=http://...).",
        epilog="Arguments after -- go to `mlflow server` as they are (e.g. -- --allowed-hosts "
               "node01:5000).")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: "
                        "every interface, for jobs on other nodes of a trusted network)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}")
    p.add_argument("--backend-store-uri", default=default_tracking_uri(root),
                   help="the database: sqlite:///<file> (default: the repository's mlflow.db, "
                        "where saopd-train logs without a server), postgresql://..., mysql://...")
    p.add_argument("--artifacts-destination", default=str(root / "mlartifacts"),
                   help="where the server stores the artifacts of the experiments it creates "
                        "(a folder, or a URI such as s3://bucket/path); default <repo>/mlartifacts")
    p.add_argument("--workers", type=int, default=None,
                   help="server processes (default: MLflow's)")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    """Print how to use the server, then replace this process with ``mlflow server`` (in
    :func:`server_environment`).

    Bad arguments, and a port another process listens on, exit with status 2 and one line
    naming the problem, before anything is printed of the server.
    """
    args_in = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in args_in:
        cut = args_in.index("--")
        args_in, extra = args_in[:cut], args_in[cut + 1:]
    args = build_parser().parse_args(args_in)
    artifacts = args.artifacts_destination
    try:
        cmd = server_command(backend_store_uri=args.backend_store_uri,
                             artifacts_destination=artifacts, host=args.host, port=args.port,
                             workers=args.workers, extra=extra)
    except ValueError as err:
        print(f"saopd tracking server: error: {err}", file=sys.stderr)
        sys.exit(2)
    why = port_taken(args.host, args.port)
    if why is not None:  # else uvicorn's refusal scrolls by and the banner names the other one
        print(f"saopd tracking server: error: {_port_refusal(args.host, args.port, why)}",
              file=sys.stderr)
        sys.exit(2)
    if "://" not in artifacts:
        Path(artifacts).expanduser().mkdir(parents=True, exist_ok=True)
    url = f"http://{_connect_host(args.host)}:{args.port}"
    remote = "http://<this host's name or address>:" + str(args.port)
    lines = [
        f"saopd tracking server: {url}  (store {args.backend_store_uri}, artifacts {artifacts})",
        f"  runs log here with:  saopd-train logger.tracking_uri={url}",
        (f"  from other nodes:    logger.tracking_uri={remote}" if args.host != "127.0.0.1"
         else "  (this machine only: --host 0.0.0.0 opens it to other nodes)"),
        f"  runs in the UI:      {experiment_url(url)}",
        f"  tables and figures:  saopd-report --tracking-uri {url} -e <experiment>",
    ]
    if args.backend_store_uri.startswith("sqlite:"):
        lines.append("  SQLite: safe while this server is its only writer and the file is on this"
                     " machine's disk; on a shared file system use PostgreSQL or MySQL")
    print("\n".join(lines), flush=True)
    os.execve(cmd[0], cmd, server_environment())


# ---- refusing SQLite for launchers that run jobs on several nodes -------------------------------

def multi_node_launcher(launcher: Mapping[str, Any]) -> str | None:
    """What makes Hydra launcher config ``launcher`` run jobs on several nodes, or None.

    SLURM (``hydra/launcher=slurm``) always may; a Ray launcher when it connects to a
    cluster (``ray.init.address`` set, e.g. ``auto`` or ``ray://head:10001``; null or ``local``
    starts a cluster on this machine) or starts one on cloud machines (Ray's AWS launcher).
    ``slurm_local``, joblib and the basic launcher run on this machine.
    """
    target = str(launcher.get("_target_", ""))
    cls = target.rsplit(".", 1)[-1]
    if "Slurm" in cls:
        return f"{cls} (hydra/launcher=slurm) runs jobs on the cluster's nodes"
    if cls.startswith("Ray"):
        if "AWS" in cls:
            return f"{cls} runs jobs on cloud machines"
        ray_conf = launcher.get("ray") or {}
        init = ray_conf.get("init") if isinstance(ray_conf, Mapping) else None
        address = init.get("address") if isinstance(init, Mapping) else None
        if address not in (None, "", "local"):
            return (f"{cls} with ray.init.address={address} runs jobs on the Ray cluster's "
                    "nodes")
    return None


def sqlite_refusal(tracking_uri: str, launcher: Mapping[str, Any]) -> str | None:
    """The reason to refuse logging to ``tracking_uri`` from jobs of ``launcher``, or None.

    Refused: a ``sqlite:`` store with a launcher of :func:`multi_node_launcher`.
    """
    if not tracking_uri.startswith("sqlite:"):
        return None
    why = multi_node_launcher(launcher)
    if why is None:
        return None
    return (f"MLflow store {tracking_uri}: {why}, and SQLite is not safe with many writers on a "
            "shared file system; start a tracking server (make mlflow-server MLFLOW_HOST=0.0.0.0"
            ", or python -m saopd.runs.server --host 0.0.0.0) and pass "
            "logger.tracking_uri=http://<server host>:5000, or use a database server "
            "(logger.tracking_uri=postgresql://...)")


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover - hydra is a dependency
    _HydraCallback = object  # type: ignore[assignment,misc]


class StoreCheck(_HydraCallback):  # type: ignore[misc]
    """Hydra callback: refuse a multi-node sweep that would log to a SQLite store.

    Runs when a sweep starts, before any job is submitted; prints ``saopd-train: error: ...``
    (:func:`sqlite_refusal`) and exits with status 2. The store is the one the jobs would use:
    ``logger.tracking_uri``, else the repository's default (as ``saopd.train`` picks it).
    """

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        """Check the sweep's launcher against its tracking store."""
        logger = config.get("logger") or {}
        if logger.get("kind", "mlflow") != "mlflow":
            return
        uri = logger.get("tracking_uri") or default_tracking_uri(config.paths.root)
        reason = sqlite_refusal(str(uri), config.hydra.launcher)
        if reason is not None:
            print(f"saopd-train: error: {reason}", file=sys.stderr, flush=True)
            # Hydra turns a callback's exceptions into warnings; SystemExit gets through
            raise SystemExit(2)


if __name__ == "__main__":
    main()
