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
from saopd.eval.benchmarks import BENCHMARKS
from saopd.runs.mlflow_logger import log_params, log_resolved_config, make_mlflow_logger
from saopd.runs.resume import RunPlan, claimed_by, write_run_record
from saopd.runs.sweeps import run_tags, sweep_run
from saopd.runs.tracking import FOLDER_TAG, RUN_UID_TAG, default_tracking_uri, read_run_tags
from saopd.runs.ui import KEY_METRICS, set_key_charts

__all__ = ["key_metrics", "run_tracking_uri", "start_tracking"]

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
    counts (params ``data_rows.<name>``: as metrics they were one-point charts that the UI's
    chart view opened on). The experiment's key charts (:func:`saopd.runs.ui.set_key_charts`:
    held-out accuracy, loss, FLMR, filtered ratio) are stored on it. Call it in the process
    that tracks (global rank 0). The info also holds ``mlflow_experiment_id``, for the UI's
    address of the experiment.
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
        log_params(logger, {f"data_rows.{name}": str(int(value))
                            for name, value in data_counts.items()})
    try:
        set_key_charts(logger.experiment, logger.experiment_id, key_metrics(conf))
    except Exception as err:  # the UI's default view only: the run goes on
        log.warning("could not store the experiment's key charts: %s", err)
    ident = plan.identity
    return [logger], {"tracking_uri": ident.tracking_uri,
                      "mlflow_experiment": ident.mlflow_experiment,
                      "mlflow_experiment_id": logger.experiment_id, "run_id": logger.run_id}


def key_metrics(conf: TrainConfig) -> list[str]:
    """The metrics of the experiment's key charts: the held-out accuracy of its first benchmark
    (``eval/<benchmark>/avg_at_<k>``, when the run evaluates), then
    :data:`saopd.runs.ui.KEY_METRICS` (loss, FLMR, filtered ratio)."""
    ev = conf.eval
    first = list(ev.benchmarks or [])[:1]
    if not first or not (ev.every_n_steps or ev.at_start):
        return list(KEY_METRICS)
    k = ev.k if ev.k is not None else BENCHMARKS.get(first[0]).k
    return [f"eval/{first[0]}/avg_at_{k}", *KEY_METRICS]


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
    tags = {**run_tags(conf), **own}
    if run_id is None:  # a sweep's job: a child of the sweep's run, named by what it varies
        job_name, parent = sweep_run(uri, name, conf.logger.run_name or conf.experiment_name,
                                     tags)
        run_name, tags = job_name or run_name, {**tags, **parent}
    logger = make_mlflow_logger(experiment_name=name, tracking_uri=uri, run_name=run_name,
                                run_id=run_id, tags=tags,
                                root=Path(conf.paths.root))
    if run_id is not None:  # a continued run: it is this folder's now
        for key, value in own.items():
            logger.experiment.set_tag(run_id, key, value)
    ident.run_id, ident.tracking_uri, ident.mlflow_experiment = logger.run_id, uri, name
    return logger, run_id is None
