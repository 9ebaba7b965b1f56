"""A run's MLflow logger, tied to its run folder: the MLflow run the folder's record names when
the run continues, a new one otherwise, and what the run logs once at its start."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from saopd.config.train import TrainConfig
from saopd.lightning.resume import RunPlan, claimed_by, write_run_record
from saopd.sweeps import run_tags
from saopd.tracking import (
    FOLDER_TAG,
    RUN_UID_TAG,
    default_tracking_uri,
    log_params,
    log_resolved_config,
    make_mlflow_logger,
    read_run_tags,
)

__all__ = ["run_tracking_uri", "start_tracking"]

log = logging.getLogger(__name__)


def start_tracking(conf: TrainConfig, plan: RunPlan, cfg: DictConfig, *,
                   changes: Mapping[str, tuple[str, str]], params: Mapping[str, Any],
                   data_counts: Mapping[str, int]) -> tuple[list[Any], dict[str, Any]]:
    """The run's loggers (``[]`` for ``logger.kind=none``) and what the summary says of them
    (``tracking_uri``, ``mlflow_experiment``, ``run_id``).

    The MLflow run is the one the folder's record names when the run continues its own run
    (and that MLflow run is not another folder's: then, and for a copy, a new one tagged with
    the run it was copied from). The MLflow fields of ``plan.identity`` are filled and the
    record rewritten. Logged at once: the resume's deliberate ``changes`` (a tag), ``params``
    (extra parameters), and for a new MLflow run the resolved config ``cfg`` and the data
    counts (``data/<name>`` at step 0). Call it in the process that tracks (global rank 0).
    The info also holds ``mlflow_experiment_id``, for the UI's address of the experiment.
    """
    if conf.logger.kind == "none":
        return [], {}
    logger, new_run = _mlflow_logger(conf, plan)
    write_run_record(plan.folder, plan.identity)  # the record names the MLflow run now
    if changes:
        logger.experiment.set_tag(logger.run_id, "saopd.resume_changes",
                                  json.dumps(changes)[:5000])
    log_params(logger, {k: str(v) for k, v in params.items()})
    if new_run:
        log_resolved_config(logger, cfg)
        for name, value in data_counts.items():
            logger.log_metrics({f"data/{name}": float(value)}, step=0)
    ident = plan.identity
    return [logger], {"tracking_uri": ident.tracking_uri,
                      "mlflow_experiment": ident.mlflow_experiment,
                      "mlflow_experiment_id": logger.experiment_id, "run_id": logger.run_id}


def run_tracking_uri(conf: TrainConfig, plan: RunPlan) -> str:
    """The MLflow store a run logs to: ``logger.tracking_uri``, else the one its folder's record
    names (a resumed run), else the repository's SQLite store."""
    return (conf.logger.tracking_uri or plan.identity.tracking_uri
            or default_tracking_uri(conf.paths.root))


def _mlflow_logger(conf: TrainConfig, plan: RunPlan) -> tuple[Any, bool]:
    """The MLflow logger and whether its run is new (see :func:`start_tracking`)."""
    ident = plan.identity
    uri = run_tracking_uri(conf, plan)
    name = conf.logger.experiment_name or conf.experiment_name
    run_name = conf.logger.run_name or (
        f"{conf.experiment_name}-{conf.filter['name']}-{conf.objective['name']}-s{conf.seed}")
    run_id = ident.run_id if plan.continues_mlflow_run else None
    if run_id is not None:  # whose is that MLflow run now? (a copy of a moved folder)
        owner = read_run_tags(uri, run_id) or {}
        if owner.get(RUN_UID_TAG, ident.run_uid) != ident.run_uid:
            plan.as_copy(owner.get(FOLDER_TAG, "?"))
        elif claimed_by(owner.get(FOLDER_TAG), ident.run_uid, plan.folder) is not None:
            plan.as_copy(owner[FOLDER_TAG])
        if plan.how == "copied":
            log.warning("resume: MLflow run %s is another folder's (%s): this run logs to a "
                        "new MLflow run", run_id, owner.get(FOLDER_TAG))
            ident, run_id = plan.identity, None
    own = {RUN_UID_TAG: ident.run_uid, FOLDER_TAG: str(plan.folder.absolute())}
    if ident.copied_from:
        parent = ident.copied_from
        own.update({"saopd.copied_from": parent.get("run_id") or parent["run_uid"],
                    "saopd.copied_from_folder": str(parent.get("folder"))})
        if parent.get("checkpoint"):
            own["saopd.copied_from_checkpoint"] = str(parent["checkpoint"])
    logger = make_mlflow_logger(experiment_name=name, tracking_uri=uri, run_name=run_name,
                                run_id=run_id, tags={**run_tags(conf), **own},
                                root=Path(conf.paths.root))
    if run_id is not None:  # a continued run: it is this folder's now
        for key, value in own.items():
            logger.experiment.set_tag(run_id, key, value)
    ident.run_id, ident.tracking_uri, ident.mlflow_experiment = logger.run_id, uri, name
    return logger, run_id is None
