"""Lightning's MLflow logger for saopd runs: continued runs without duplicated points, params
within MLflow's limits, the resolved config as an artifact.

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
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import yaml
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig

from saopd.paths import default_tracking_uri
from saopd.runs.tracking import (
    CONFIG_ARTIFACT,
    CONFIG_HASH_TAG,
    MAX_PARAMS_PER_BATCH,
    StoreLockTimeout,
    flatten_params,
    is_file_store,
    local_artifact_location,
    plain_config,
    server_down,
    store_lock,
)
from saopd.runs.ui import get_or_create_experiment

__all__ = [
    "ResumableMLFlowLogger",
    "last_logged_step",
    "log_params",
    "log_resolved_config",
    "log_text_artifact",
    "make_mlflow_logger",
]

log = logging.getLogger(__name__)

_LIGHTNING_METRIC_CHARS = re.compile(r"[^a-zA-Z0-9_/. -]+")  # what MLFlowLogger keeps in keys


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
    if is_file_store(uri):
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
    plain = plain_config(cfg)
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
