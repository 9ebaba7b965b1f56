"""MLflow stores and runs, without Lightning: the local SQLite store by default, servers, status.

Store. MLflow's file store (``./mlruns``) is refused by current MLflow (3.x raises unless
``MLFLOW_ALLOW_FILE_STORE=true``) and Lightning's ``MLFlowLogger`` falls back to it when no URI is
given, so a URI is always passed: ``sqlite:///<root>/mlflow.db`` unless told otherwise, with the
artifacts of experiments created here under ``<root>/mlartifacts``. Creating a fresh SQLite store
runs MLflow's schema migrations once (about 2 s here); reopening an existing one is fast. Browse
with ``mlflow ui --backend-store-uri sqlite:///<root>/mlflow.db --host 127.0.0.1``.

Tracking servers. MLflow's HTTP client retries a failed request 7 times with a doubling backoff
and waits 120 s for each answer, so a dead server held a run for minutes per call.
:func:`bound_http_retries` sets a smaller budget (:data:`HTTP_RETRY_BUDGET`: 3 retries, backoff
factor 1, 15 s per answer: about 10 s for a server that refuses connections, about a minute for
one that accepts them and never answers) unless the environment sets MLflow's own variables
(``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, ``MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR``,
``MLFLOW_HTTP_REQUEST_TIMEOUT``); :func:`check_tracking_server` asks ``GET <uri>/health`` before
a run starts, and :func:`server_down` tells a run that failed whether its server stopped
answering.

Lightning's MLflow logger (runs continued without duplicated points, the resolved config as
params and an artifact) is :mod:`saopd.runs.mlflow_logger`: this module imports no Lightning,
so that a sweep's callbacks and the command line stay light.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from saopd.paths import default_tracking_uri
from saopd.runs.ui import get_or_create_experiment

__all__ = [
    "CONFIG_ARTIFACT",
    "CONFIG_HASH_TAG",
    "FOLDER_TAG",
    "HTTP_RETRY_BUDGET",
    "RUN_UID_TAG",
    "STORE_LOCK_TIMEOUT_S",
    "StoreLockTimeout",
    "bound_http_retries",
    "check_tracking_server",
    "create_parent_run",
    "default_tracking_uri",
    "end_parent_run",
    "flatten_params",
    "is_file_store",
    "local_artifact_location",
    "plain_config",
    "read_run_tags",
    "server_down",
    "store_lock",
    "store_lock_timeout",
]

log = logging.getLogger(__name__)

# MLflow limits (mlflow.utils.validation, 3.x): param value length, params per log_batch call, and
# the length of a param/metric key.
MAX_PARAM_VALUE_LENGTH = 6000
MAX_PARAMS_PER_BATCH = 100
MAX_KEY_LENGTH = 250

CONFIG_ARTIFACT = "config/config.yaml"
"""Where :func:`log_resolved_config` stores the resolved config inside the run's artifacts."""

CONFIG_HASH_TAG = "saopd.config_sha256"
"""Run tag: SHA-256 of the YAML first logged as :data:`CONFIG_ARTIFACT`."""

RUN_UID_TAG = "saopd.run_uid"
"""Run tag: the saopd run (``run_uid`` of its folder's record) whose steps the MLflow run holds."""

FOLDER_TAG = "saopd.folder"
"""Run tag: the run folder that last wrote to the MLflow run (a copy elsewhere is another run)."""

_SQLITE_PREFIX = "sqlite:///"
_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")  # MLflow accepts /, word chars, '.', '-', ' ', ':'


#: Seconds :func:`store_lock` waits for another process's lock on a SQLite store.
STORE_LOCK_TIMEOUT_S = 120.0


class StoreLockTimeout(TimeoutError):
    """The lock of a local MLflow store stayed held longer than the timeout."""


#: MLflow's HTTP client settings saopd uses unless the environment sets them: at most 3 retries,
#: 0, 2 and 4 s apart (plus up to 1 s of jitter each), and 15 s for each answer.
HTTP_RETRY_BUDGET = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
                     "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                     "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}

#: Seconds :func:`server_down` waits for ``GET /health``.
HEALTH_TIMEOUT_S = 5.0


def bound_http_retries() -> dict[str, str]:
    """Set :data:`HTTP_RETRY_BUDGET` in this process's environment where the variable is unset
    (MLflow reads them at every request, and jobs started from here inherit them); returns
    the values in force."""
    for name, value in HTTP_RETRY_BUDGET.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in HTTP_RETRY_BUDGET}


def _is_server_uri(uri: str | None) -> bool:
    return bool(uri) and str(uri).startswith(("http://", "https://"))


def server_down(uri: str | None, timeout_s: float = HEALTH_TIMEOUT_S) -> str | None:
    """Why the MLflow tracking server at ``uri`` does not answer ``GET <uri>/health`` with 200
    within ``timeout_s`` seconds (e.g. ``"Connection refused"``), None when it does or when
    ``uri`` is not a server (``sqlite:``, ``postgresql:``, ...)."""
    if not _is_server_uri(uri):
        return None
    import urllib.error
    import urllib.request

    health = str(uri).rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(health, timeout=timeout_s) as reply:
            return None if reply.status == 200 else f"HTTP {reply.status}"
    except urllib.error.HTTPError as err:
        return f"HTTP {err.code} from {health}"
    except urllib.error.URLError as err:
        reason = err.reason
        return str(getattr(reason, "strerror", None) or reason)
    except (OSError, ValueError) as err:  # a timeout, a reset connection, a malformed address
        return str(err) or type(err).__name__


def check_tracking_server(uri: str | None) -> None:
    """Bound MLflow's HTTP retries (:func:`bound_http_retries`) and, for a server ``uri``
    (``http(s)://``), check that it answers ``GET /health``; other stores pass.

    Raises ``ValueError`` naming the URI and the reason when the server does not answer."""
    bound_http_retries()
    why = server_down(uri)
    if why is not None:
        raise ValueError(f"MLflow tracking server {uri} does not answer GET /health ({why}): "
                         "start it (python -m saopd.runs.server, or make mlflow-server) "
                         "or set logger.tracking_uri to a running one")


# ---- store and logger ---------------------------------------------------------------------------

def is_file_store(uri: str) -> bool:
    """True for ``file:`` URIs and bare paths, which MLflow maps to its refused file store."""
    if uri == "databricks" or uri.startswith("databricks"):
        return False
    scheme = uri.split(":", 1)[0] if ":" in uri else ""
    return scheme in ("", "file") or len(scheme) == 1  # len 1: a Windows drive letter


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (``None`` for other stores or in-memory)."""
    if not uri.startswith(_SQLITE_PREFIX):
        return None
    rest = uri[len(_SQLITE_PREFIX):].split("?", 1)[0]
    return Path(rest) if rest and rest != ":memory:" else None


def local_artifact_location(uri: str, experiment_name: str) -> str | None:
    """Where a new experiment of a local SQLite store keeps its artifacts, or None elsewhere.

    ``file:`` URI of ``<store folder>/mlartifacts/<experiment>`` (the name made file-safe), so
    artifacts sit beside the database whatever the working directory (MLflow's own default for
    a SQLite store is ``./mlartifacts`` of the current directory). Pass it as the
    ``artifact_location`` of the experiment's creation. Creates the store's folder (MLflow
    creates the database file, not its folder); None for other stores (servers keep theirs).
    """
    db = _sqlite_path(uri)
    if db is None:
        return None
    folder = db.expanduser().resolve().parent
    folder.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^\w.\-]+", "_", experiment_name).strip("._") or "experiment"
    return (folder / "mlartifacts" / safe).as_uri()


@contextmanager
def store_lock(uri: str, timeout_s: float | None = None) -> Iterator[None]:
    """Hold an inter-process lock on a local SQLite store (no-op for other stores).

    Parallel sweep jobs (``hydra/launcher=joblib``) may open a new SQLite store at the same
    moment: its schema migration and an experiment's creation are not safe to race, so one
    process at a time opens the store and creates experiments and runs under this lock.

    The lock is ``<store>.lock`` (an OS file lock: a killed holder releases it). Waiting longer
    than ``timeout_s`` (default ``$SAOPD_STORE_LOCK_TIMEOUT`` or :data:`STORE_LOCK_TIMEOUT_S`)
    raises :class:`StoreLockTimeout` naming the lock file, instead of hanging.
    """
    db = _sqlite_path(uri)
    if db is None:
        yield
        return
    from filelock import FileLock, Timeout

    if timeout_s is None:
        timeout_s = store_lock_timeout()
    db.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(db) + ".lock", timeout=timeout_s)
    try:
        lock.acquire()
    except Timeout:
        raise StoreLockTimeout(
            f"MLflow store {db}: its lock {lock.lock_file} is held by another process for more "
            f"than {timeout_s:g} s (another saopd job opening the store, or a stuck one: find it "
            f"with `fuser {lock.lock_file}`); set SAOPD_STORE_LOCK_TIMEOUT to wait longer"
        ) from None
    try:
        yield
    finally:
        lock.release()


def store_lock_timeout() -> float:
    """Seconds :func:`store_lock` waits: ``$SAOPD_STORE_LOCK_TIMEOUT`` when set, else
    :data:`STORE_LOCK_TIMEOUT_S`. Raises ``ValueError`` naming the variable when it is not a
    number >= 0."""
    text = os.environ.get("SAOPD_STORE_LOCK_TIMEOUT")
    if text is None:
        return STORE_LOCK_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"SAOPD_STORE_LOCK_TIMEOUT={text!r} is not a number of seconds >= 0 "
                         "(how long to wait for the MLflow store's lock)")
    return value


def read_run_tags(uri: str, run_id: str) -> dict[str, str] | None:
    """The tags of MLflow run ``run_id`` in store ``uri``; None when the store or the run does
    not exist (a local SQLite store is not created by asking)."""
    from mlflow.exceptions import MlflowException

    db = _sqlite_path(uri)
    if db is not None and not db.is_file():
        return None
    import mlflow

    try:
        with store_lock(uri):
            return dict(mlflow.MlflowClient(uri).get_run(run_id).data.tags)
    except MlflowException:
        return None


# ---- params and config --------------------------------------------------------------------------

def plain_config(obj: Any) -> Any:
    """Config as plain dicts/lists/scalars (OmegaConf resolved; other objects as ``str``)."""
    if isinstance(obj, DictConfig | ListConfig):
        obj = OmegaConf.to_container(obj, resolve=True)
    if isinstance(obj, Mapping):
        return {str(k): plain_config(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [plain_config(v) for v in obj]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    return str(obj)


def flatten_params(cfg: DictConfig | Mapping[str, Any]) -> dict[str, str]:
    """Flatten a (resolved) config to MLflow params: dotted keys, string values.

    Nested mappings become ``a.b.c``; lists holding mappings or lists are indexed (``a.0.b``),
    lists of scalars stay one value (``"[1, 2]"``); an empty mapping is ``"{}"``. Characters
    MLflow refuses in keys become ``_``; values are cut to 6000 characters (MLflow's limit).
    """
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}" if prefix else str(i), v)
        else:
            key = _BAD_KEY_CHARS.sub("_", prefix)[:MAX_KEY_LENGTH]
            out[key] = str(value)[:MAX_PARAM_VALUE_LENGTH]

    walk("", plain_config(cfg))
    return out


def mark_run_failed(uri: str, run_id: str | None, *, experiment: str,
                    tags: Mapping[str, str], error: str, run_name: str | None = None) -> str:
    """Mark MLflow run ``run_id`` FAILED with its ``error`` tag (cut to 5,000 characters); with
    no ``run_id`` (a job that failed before training made its run) make one named
    ``run_name`` in ``experiment`` with ``tags`` first, so that every job of a sweep is in
    MLflow. Returns the run's id."""
    import mlflow

    with store_lock(uri):
        client = mlflow.MlflowClient(uri)
        if run_id is None:
            exp_id = get_or_create_experiment(
                client, experiment, artifact_location=local_artifact_location(uri, experiment))
            run_id = client.create_run(exp_id, run_name=run_name, tags=dict(tags)).info.run_id
        client.set_tag(run_id, "error", error[:5000])
        client.set_terminated(run_id, status="FAILED")
    return run_id


def create_parent_run(uri: str, experiment: str, *, run_name: str,
                      tags: Mapping[str, str]) -> str:
    """Create a RUNNING run named ``run_name`` in ``experiment`` (created if missing, with the
    artifacts of :func:`local_artifact_location`) under the store's lock: the parent of a
    sweep's jobs (:func:`saopd.runs.sweeps.sweep_run`). Returns its id."""
    import mlflow

    with store_lock(uri):
        client = mlflow.MlflowClient(uri)
        exp_id = get_or_create_experiment(
            client, experiment, artifact_location=local_artifact_location(uri, experiment))
        return client.create_run(exp_id, run_name=run_name, tags=dict(tags)).info.run_id


def end_parent_run(uri: str, run_id: str, *, status: str, tags: Mapping[str, str]) -> None:
    """Set ``tags`` on a sweep's parent run and end it with ``status`` (FINISHED, FAILED or
    KILLED)."""
    import mlflow

    with store_lock(uri):
        client = mlflow.MlflowClient(uri)
        for key, value in tags.items():
            client.set_tag(run_id, key, value)
        client.set_terminated(run_id, status=status)


def mark_run_killed(uri: str, run_id: str) -> None:
    """Mark MLflow run ``run_id`` KILLED (a job stopped by a signal, its last step saved)."""
    import mlflow

    mlflow.MlflowClient(uri).set_terminated(run_id, status="KILLED")
