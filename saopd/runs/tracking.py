"""MLflow tracking for Lightning runs: a local SQLite store by default, configs, artifacts, resume.

Store. MLflow's file store (``./mlruns``) is refused by current MLflow (3.x raises unless
``MLFLOW_ALLOW_FILE_STORE=true``) and Lightning's ``MLFlowLogger`` falls back to it when no URI is
given, so a URI is always passed: ``sqlite:///<root>/mlflow.db`` unless told otherwise, with the
artifacts of experiments created here under ``<root>/mlartifacts``. Creating a fresh SQLite store
runs MLflow's schema migrations once (about 2 s here); reopening an existing one is fast. Browse
with ``mlflow ui --backend-store-uri sqlite:///<root>/mlflow.db --host 127.0.0.1``.

Metrics and resume. Lightning's ``MLFlowLogger.log_metrics`` sends every value with the trainer's
``global_step`` as its MLflow ``step`` (``None`` becomes 0) and the wall-clock time as its
timestamp. MLflow keeps a metric *history*: logging the same key at the same step again, with a
new timestamp, adds a second point rather than replacing the first (the "latest" value is the one
with the highest step, then timestamp). So a run resumed from a checkpoint older than the last
logged step (crash at step 130, checkpoint at 100) would log steps 101..130 twice. MLflow's client
cannot delete single points, so :class:`ResumableMLFlowLogger` (what :func:`make_mlflow_logger`
returns) drops, per metric key, values at steps <= the last step already in the run's history
when it continues an existing run: the history keeps the first trajectory up to that step and
continues with the resumed one after it. :func:`last_logged_step` reads that history.

Tracking servers. MLflow's HTTP client retries a failed request 7 times with a doubling backoff
and waits 120 s for each answer, so a dead server held a run for minutes per call.
:func:`bound_http_retries` sets a smaller budget (:data:`HTTP_RETRY_BUDGET`: 3 retries, backoff
factor 1, 15 s per answer: about 10 s for a server that refuses connections, about a minute for
one that accepts them and never answers) unless the environment sets MLflow's own variables
(``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, ``MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR``,
``MLFLOW_HTTP_REQUEST_TIMEOUT``); :func:`check_tracking_server` asks ``GET <uri>/health`` before
a run starts, and :func:`server_down` tells a run that failed whether its server stopped
answering.

Params. MLflow refuses to change a param's value once logged. :func:`log_resolved_config` (and the
logger's ``log_hyperparams``) therefore skip params already logged with the same value and report,
rather than fail on, params whose value changed (e.g. ``trainer.max_steps`` raised on resume); the
changed config is kept as a separate YAML artifact.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

import yaml
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only
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
    "ResumableMLFlowLogger",
    "StoreLockTimeout",
    "bound_http_retries",
    "check_tracking_server",
    "create_parent_run",
    "default_tracking_uri",
    "end_parent_run",
    "flatten_params",
    "last_logged_step",
    "local_artifact_location",
    "log_params",
    "log_resolved_config",
    "log_text_artifact",
    "make_mlflow_logger",
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
_LIGHTNING_METRIC_CHARS = re.compile(r"[^a-zA-Z0-9_/. -]+")  # what MLFlowLogger keeps in keys


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

def _is_file_store(uri: str) -> bool:
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


class ResumableMLFlowLogger(MLFlowLogger):
    """Lightning's ``MLFlowLogger`` that does not duplicate points when it continues a run.

    With ``skip_logged_steps`` (default) and a ``run_id`` (resume), a metric value is dropped
    when its step is <= the last step of that key already stored in the run (read once per key
    from MLflow, see :func:`last_logged_step`). A new run starts with empty histories, so nothing
    is dropped. ``log_hyperparams`` goes through :func:`log_params`: values are cut to MLflow's
    6000-character limit (Lightning cuts at 250) and already-logged params are not re-sent.
    """

    def __init__(self, *args: Any, skip_logged_steps: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._uri: str | None = kwargs.get("tracking_uri")
        self._resumed = self._run_id is not None  # continuing an existing run
        self._skip_logged_steps = skip_logged_steps
        self._logged_upto: dict[str, int | None] = {}  # metric key (as stored) -> last step

    def _stored_key(self, key: str) -> str:
        """The key as ``MLFlowLogger.log_metrics`` stores it (prefix added, characters cleaned)."""
        if self._prefix:
            key = f"{self._prefix}{self.LOGGER_JOIN_CHAR}{key}"
        return _LIGHTNING_METRIC_CHARS.sub("", key)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Log ``metrics`` at ``step``; on a resumed run, skip steps already in the history."""
        if self._resumed and self._skip_logged_steps:
            at = step or 0
            kept = {}
            for key, value in metrics.items():
                stored = self._stored_key(key)
                if stored not in self._logged_upto:
                    self._logged_upto[stored] = last_logged_step(self, stored)
                upto = self._logged_upto[stored]
                if upto is None or at > upto:
                    kept[key] = value
            metrics = kept
            if not metrics:
                return
        super().log_metrics(metrics, step)

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        """Mark the run ended; a run that failed because its tracking server stopped answering
        is left as it is (another round of retries would only delay the error)."""
        if status == "failed" and server_down(self._uri) is not None:
            log.warning("MLflow tracking server %s does not answer: run %s not marked failed",
                        self._uri, self._run_id)
            return
        super().finalize(status)

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        """Flatten and log ``params`` (dict, Namespace or DictConfig) via :func:`log_params`."""
        if not isinstance(params, DictConfig | Mapping):
            params = vars(params)
        log_params(self, flatten_params(params))


def make_mlflow_logger(*, experiment_name: str, tracking_uri: str | None, run_name: str | None,
                       run_id: str | None = None, tags: dict[str, Any] | None = None,
                       root: Path, skip_logged_steps: bool = True) -> ResumableMLFlowLogger:
    """An ``MLFlowLogger`` on an explicit store, new run or continued one.

    Args:
        experiment_name: MLflow experiment, created if missing (ignored when ``run_id`` is given:
            the run's own experiment is used).
        tracking_uri: any MLflow URI; ``None`` uses ``$MLFLOW_TRACKING_URI`` when set, else
            :func:`default_tracking_uri` of ``root``. File stores are refused (``ValueError``).
        run_name: display name of a new run.
        run_id: continue this existing run (resume): same run, new metrics appended. The run must
            exist and not be deleted; a finished/failed run is set back to RUNNING.
        tags: tags of a new run.
        root: the repository root: holds ``mlflow.db`` by default. The artifacts of experiments
            created in a local SQLite store go beside its database file
            (``<store folder>/mlartifacts/<experiment>``).
        skip_logged_steps: on resume, drop metric values at already-logged steps (see
            :class:`ResumableMLFlowLogger`).
    """
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(root)
    if _is_file_store(uri):
        raise ValueError(
            f"tracking URI {uri!r} is an MLflow file store, which current MLflow refuses; use a "
            f"database store such as {default_tracking_uri(root)!r} (the default) or a server URL"
        )
    artifact_location = local_artifact_location(uri, experiment_name)

    def build() -> ResumableMLFlowLogger:
        return ResumableMLFlowLogger(
            experiment_name=experiment_name, run_name=run_name, tracking_uri=uri,
            tags=dict(tags) if tags else None, artifact_location=artifact_location,
            run_id=run_id, skip_logged_steps=skip_logged_steps,
        )

    if rank_zero_only.rank != 0:
        return build()
    with store_lock(uri):
        try:
            if run_id is None:  # the experiment, tagged as model training (saopd.runs.ui)
                from mlflow import MlflowClient

                get_or_create_experiment(MlflowClient(uri), experiment_name,
                                         artifact_location=artifact_location)
            logger = build()
            if run_id is None:
                _ = logger.run_id  # creates the run now, under the lock
            else:
                _reopen_run(logger, run_id)
        except Exception as err:
            if "database is locked" not in str(err):
                raise
            raise StoreLockTimeout(
                f"MLflow store {uri}: the database is locked by another process (one outside "
                "saopd's lock, e.g. an `mlflow ui` writing, or a stuck job); retry when it is "
                "free") from None
    return logger


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


def _reopen_run(logger: MLFlowLogger, run_id: str) -> None:
    """Check that ``run_id`` can be continued and mark it RUNNING again."""
    from mlflow.exceptions import MlflowException

    try:
        client = logger.experiment  # MLFlowLogger looks the run up here
        run = client.get_run(run_id)
    except MlflowException as err:
        raise ValueError(f"cannot resume MLflow run {run_id!r}: {err.message}") from err
    if run.info.lifecycle_stage == "deleted":
        raise ValueError(f"cannot resume MLflow run {run_id!r}: it is deleted")
    if run.info.status != "RUNNING":
        client.update_run(run_id, status="RUNNING")


# ---- reading back -------------------------------------------------------------------------------

def last_logged_step(logger: MLFlowLogger, metric_key: str) -> int | None:
    """Highest step stored for ``metric_key`` in the logger's run, ``None`` if never logged.

    ``metric_key`` is the key as stored in MLflow (with the logger's prefix, if any). Reads the
    full metric history through ``MlflowClient.get_metric_history``. On ranks other than 0 the
    logger has no run and the answer is ``None``.
    """
    if rank_zero_only.rank != 0:
        return None
    history = logger.experiment.get_metric_history(logger.run_id, metric_key)
    return max((m.step for m in history), default=None)


# ---- params and config --------------------------------------------------------------------------

def _to_plain(obj: Any) -> Any:
    """Config as plain dicts/lists/scalars (OmegaConf resolved; other objects as ``str``)."""
    if isinstance(obj, DictConfig | ListConfig):
        obj = OmegaConf.to_container(obj, resolve=True)
    if isinstance(obj, Mapping):
        return {str(k): _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_to_plain(v) for v in obj]
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

    walk("", _to_plain(cfg))
    return out


@rank_zero_only
def log_params(logger: MLFlowLogger, params: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Log string params in batches of 100, skipping those already logged with the same value.

    Returns the params that were already logged with a *different* value, as
    ``{key: (logged, new)}``: MLflow forbids changing them, so they are left as they are and a
    warning is issued.
    """
    from mlflow.entities import Param

    client, run_id = logger.experiment, logger.run_id
    existing = client.get_run(run_id).data.params
    changed = {k: (existing[k], v) for k, v in params.items() if k in existing and existing[k] != v}
    new = [Param(k, v) for k, v in params.items() if k not in existing]
    for i in range(0, len(new), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=new[i:i + MAX_PARAMS_PER_BATCH])
    if changed:
        log.warning("MLflow run %s already has different values for %d param(s), kept: %s",
                    run_id, len(changed), ", ".join(sorted(changed)))
    return changed


@rank_zero_only
def log_resolved_config(logger: MLFlowLogger,
                        cfg: DictConfig | Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """Log a config as flattened params and as the YAML artifact ``config/config.yaml``.

    Interpolations are resolved. Params follow :func:`flatten_params` and :func:`log_params`
    (returns its ``{key: (logged, new)}`` of changed values). When the run already holds a
    different ``config/config.yaml`` (a resumed run whose config changed), the new YAML is logged
    beside it as ``config/config.resume-<n>.yaml`` and the original is kept. The run's tag
    ``saopd.config_sha256`` holds the hash of the original YAML, to tell the two cases apart
    without downloading it.
    """
    plain = _to_plain(cfg)
    text = yaml.safe_dump(plain, sort_keys=False, allow_unicode=True, default_flow_style=False)
    changed = log_params(logger, flatten_params(plain))

    client, run_id = logger.experiment, logger.run_id
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    logged = client.get_run(run_id).data.tags.get(CONFIG_HASH_TAG)
    target = CONFIG_ARTIFACT
    if logged == digest:
        return changed
    if logged is not None:
        folder = str(PurePosixPath(CONFIG_ARTIFACT).parent)
        present = [PurePosixPath(f.path).name for f in client.list_artifacts(run_id, folder)]
        n = 1 + sum(1 for name in present if name.startswith("config.resume-"))
        target = f"{folder}/config.resume-{n}.yaml"
    else:
        client.set_tag(run_id, CONFIG_HASH_TAG, digest)
    log_text_artifact(logger, text, target)
    return changed


@rank_zero_only
def log_text_artifact(logger: MLFlowLogger, text: str, artifact_path: str) -> None:
    """Store ``text`` (UTF-8) as the artifact file ``artifact_path`` of the logger's run.

    ``artifact_path`` is the file's path inside the run's artifacts, e.g.
    ``"token_view/step_000100.html"``; an existing file there is replaced. The text is written
    to a temporary directory that is removed afterwards.
    """
    path = PurePosixPath(artifact_path)
    if not path.name or path.is_absolute() or ".." in path.parts:
        raise ValueError(f"artifact_path must be a relative file path, got {artifact_path!r}")
    folder = None if str(path.parent) == "." else str(path.parent)
    with tempfile.TemporaryDirectory(prefix="saopd-mlflow-") as tmp:
        local = Path(tmp) / path.name
        local.write_text(text, encoding="utf-8")
        logger.experiment.log_artifact(logger.run_id, str(local), folder)


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
