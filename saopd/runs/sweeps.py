"""Hydra sweeps that survive failed jobs, with one MLflow run per job.

``saopd-train -m ...`` runs one job per combination. A job that fails (a bad combination of
hyperparameters, NaN, out of memory) must not stop the sweep: in multirun mode
:func:`saopd.train.app` catches the error, logs it with its traceback, writes
``<job dir>/FAILED.json``, marks the job's MLflow run FAILED (creating one tagged with the sweep
if training had not started one yet) and returns, so Hydra goes on with the next job. A job
stopped by ``SIGTERM`` (``scancel``, ``kill``; not a launcher's preemption signal, which
requeues it) saves its step, writes ``<job dir>/KILLED.json`` with the command that continues it
(:func:`record_killed_job`) and returns the same way: the launcher (submitit's above all) gets a
result, and the sweep's summary lists the job as ``killed``.

:class:`SweepSummary`, a Hydra callback configured in ``conf/train.yaml``, appends each job's
outcome to ``<sweep dir>/jobs.jsonl`` as it ends (also from joblib worker processes) and, when the
sweep is over, writes ``<sweep dir>/sweep_summary.json``, prints a table of the jobs and exits
with status 1 if any failed: the sweep ran to the end, and the shell still learns that it was
not clean.

MLflow. A sweep (or an Optuna search) is one *parent* run in MLflow with its jobs as child runs
(MLflow's tag ``mlflow.parentRunId``, set when a job's run is created). The parent is created by
the first job that needs it, under a file lock in the sweep folder (``<sweep dir>/
mlflow_parent.json`` keeps its id per store and experiment), so parallel jobs and jobs on other
nodes share it; :class:`SweepSummary` marks it FINISHED (FAILED or KILLED when a job was) when
the sweep ends. Each job's run is named by :func:`job_run_name`: the experiment name, the job
number and the overrides that differ across the sweep (``tiny #1 seed=1``), which
:meth:`SweepSummary.on_multirun_start` writes to ``<sweep dir>/sweep.json`` before the first job.
"""

from __future__ import annotations

import json
import logging
import os
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from saopd.runs.tracking import create_parent_run, end_parent_run, mark_run_failed
from saopd.runs.ui import SWEEP_PARENT_TAG as PARENT_TAG

log = logging.getLogger(__name__)
JOBS_FILE = "jobs.jsonl"
SUMMARY_FILE = "sweep_summary.json"
FAILED_FILE = "FAILED.json"
KILLED_FILE = "KILLED.json"
SWEEP_FILE = "sweep.json"
PARENT_FILE = "mlflow_parent.json"
PARENT_RUN_TAG = "mlflow.parentRunId"
"""MLflow's tag naming a run's parent: set on every job's run of a sweep."""


def is_multirun() -> bool:
    """True inside a Hydra multirun job."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    except (ImportError, ValueError):  # pragma: no cover - Hydra missing or not initialised
        return False


def sweep_tags() -> dict[str, str]:
    """MLflow tags naming the sweep and job of this process ({} outside a multirun)."""
    if not is_multirun():
        return {}
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    return {"sweep": str(Path(hc.sweep.dir).resolve()), "sweep_job": str(hc.job.num),
            "overrides": " ".join(hc.overrides.task)}


def varying_keys(overrides: Sequence[str],
                 params: Mapping[str, Any] | None = None) -> list[str]:
    """The keys a sweep gives several values, in order: those of ``overrides`` (the command
    line's, e.g. ``seed=0,1``, ``filter.p1=interval(0.1, 0.5)``) and of ``params`` (a
    sweeper's ``hydra.sweeper.params``) that are sweeps (``a,b``, ``range``, ``choice``,
    ``interval``). Text Hydra cannot parse is left out (Hydra itself reports it)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    texts = [*overrides, *(f"{k}={v}" for k, v in (params or {}).items())]
    keys: list[str] = []
    for text in texts:
        try:
            (override,) = parser.parse_overrides([text])
        except Exception:  # not ours to judge
            continue
        if override.is_sweep_override() and override.key_or_group not in keys:
            keys.append(override.key_or_group)
    return keys


def _short_value(text: str) -> str:
    """An override's value for a run name: a float with at most 4 significant digits."""
    try:
        value = float(text)
    except ValueError:
        return text
    return f"{value:.4g}" if any(c in text for c in ".eE") else text


def job_run_name(base: str, job: int | str, overrides: Sequence[str],
                 varying: Sequence[str] | None) -> str:
    """The MLflow run name of sweep job ``job``: ``base`` (the experiment name), ``#<job>`` and
    the job's ``overrides`` whose key is in ``varying`` (all of them when ``varying`` is None),
    floats cut to 4 significant digits: ``tiny #3 filter.p1=0.2749 filter.p2=0.41``. The job
    number keeps names unique when two jobs' shown values round alike."""
    shown = []
    for text in overrides:
        key, sep, value = text.partition("=")
        key = key.lstrip("+~")
        if not sep or (varying is not None and key not in varying) or key.startswith("hydra."):
            continue
        shown.append(f"{key}={_short_value(value)}")
    return " ".join([base, f"#{job}", *shown])


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def sweep_run(uri: str, experiment: str, base_name: str,
              tags: Mapping[str, str]) -> tuple[str | None, dict[str, str]]:
    """The MLflow run name and the parent tag of this sweep job's new run; ``(None, {})``
    outside a multirun.

    The parent run (one per sweep, store and experiment) is read from, or created and written
    to, ``<sweep dir>/mlflow_parent.json`` under a file lock, so that the first job makes it
    and the others find it. It is named ``<experiment> sweep <folder>`` (``search`` for an
    Optuna search) and carries the tags of ``tags`` that name the sweep (``study``,
    ``hparams_search``, ``experiment``), ``saopd.sweep`` (the sweep folder; ``sweep`` stays
    the jobs' tag, so that ``-t sweep=...`` selects the jobs only), ``saopd.sweep_parent`` and
    the command line's overrides."""
    if not is_multirun():
        return None, {}
    from filelock import FileLock
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    sweep_dir = Path(hc.sweep.dir).resolve()
    record = _read_json(sweep_dir / SWEEP_FILE)
    name = job_run_name(base_name, hc.job.num, list(hc.overrides.task),
                        record.get("varying"))
    path = sweep_dir / PARENT_FILE
    key = f"{uri} {experiment}"
    with FileLock(str(path) + ".lock"):
        parents = _read_json(path)
        if key not in parents:
            kind = "search" if tags.get("hparams_search") else "sweep"
            parent_tags = {k: v for k, v in tags.items()
                           if k in ("study", "hparams_search", "experiment")}
            parent_tags.update({PARENT_TAG: "true", "saopd.sweep": str(sweep_dir),
                                "overrides": " ".join(record.get("overrides", []))})
            run_id = create_parent_run(uri, experiment, run_name=f"{experiment} {kind} "
                                       f"{sweep_dir.name}", tags=parent_tags)
            parents[key] = {"tracking_uri": uri, "experiment": experiment, "run_id": run_id}
            _write_json(path, parents)
    return name, {PARENT_RUN_TAG: parents[key]["run_id"]}


def parent_runs(sweep_dir: Path) -> list[dict[str, str]]:
    """The sweep's MLflow parent runs (``tracking_uri``, ``experiment``, ``run_id``), as
    :func:`sweep_run` recorded them."""
    return list(_read_json(Path(sweep_dir) / PARENT_FILE).values())


def record_job_failure(job_dir: Path, error: BaseException) -> dict[str, Any]:
    """Write ``job_dir/FAILED.json`` (error type, message, traceback, overrides); return it."""
    info = {"error_type": type(error).__name__, "error": str(error),
            "traceback": "".join(traceback.format_exception(error)), **sweep_tags()}
    job_dir.mkdir(parents=True, exist_ok=True)
    tmp = job_dir / (FAILED_FILE + ".tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp, job_dir / FAILED_FILE)
    return info


def record_killed_job(job_dir: Path, *, saved: str) -> dict[str, Any]:
    """Write ``job_dir/KILLED.json`` for a sweep job stopped by ``SIGTERM``: ``saved`` (which
    step is saved, as :func:`saopd.train.saved_step` says it), the job's overrides and
    ``resume``, the command that continues the job in its folder; return it."""
    tags = sweep_tags()
    overrides = [o for o in tags.get("overrides", "").split()
                 if not o.lstrip("+~").startswith("resume=")]
    info = {"signal": "SIGTERM", "saved": saved,
            "resume": " ".join(["saopd-train", *overrides, f"resume={job_dir.absolute()}"]),
            **tags}
    job_dir.mkdir(parents=True, exist_ok=True)
    tmp = job_dir / (KILLED_FILE + ".tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp, job_dir / KILLED_FILE)
    return info


def run_tags(conf: Any) -> dict[str, str]:
    """MLflow tags of a run: experiment, filter, objective, seed, sweep and job
    (:func:`sweep_tags`), study, method and the user's ``logger.tags``.

    ``conf``: the validated :class:`~saopd.config.train.TrainConfig` or, for a job that failed
    before validation, the raw Hydra config."""
    named = {k: getattr(conf, k, None) for k in ("study", "method")}
    tags = {"experiment": conf.experiment_name, "filter": conf.filter["name"],
            "objective": conf.objective["name"], "seed": conf.seed, **sweep_tags(),
            **{k: v for k, v in named.items() if v}, **(conf.logger.tags or {})}
    return {k: str(v) for k, v in tags.items()}


def record_failed_job(job_dir: Path, error: BaseException, *, tracking_uri: str | None,
                      run_id: str | None, experiment: str, tags: Mapping[str, str],
                      with_traceback: bool = True) -> dict[str, Any]:
    """A sweep job that failed: log it (``with_traceback``: its traceback too), write
    ``job_dir/FAILED.json`` (:func:`record_job_failure`) and, with a ``tracking_uri``, mark its
    MLflow run ``run_id`` FAILED (:func:`saopd.runs.tracking.mark_run_failed`: one is made in
    ``experiment`` with ``tags`` when the job failed before training made it). An MLflow
    error is a warning: the failure is in ``FAILED.json`` and the log already. Returns what
    ``FAILED.json`` holds."""
    log.error("sweep job failed: %s: %s", type(error).__name__, error,
              exc_info=error if with_traceback else None)
    info = record_job_failure(job_dir, error)
    if tracking_uri is not None:
        try:
            name, parent = (None, {}) if run_id is not None else sweep_run(
                tracking_uri, experiment, str(tags.get("experiment", experiment)), tags)
            mark_run_failed(tracking_uri, run_id, experiment=experiment,
                            tags={**tags, **parent}, error=info["error"], run_name=name)
        except Exception as mlflow_err:
            log.warning("could not record the failed job in MLflow: %s", mlflow_err)
    return info


def _append_line(path: Path, row: dict[str, Any]) -> None:
    """Append one JSON line under an exclusive lock (jobs may end in parallel processes)."""
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"), path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def read_jobs(sweep_dir: Path) -> list[dict[str, Any]]:
    """The job outcomes recorded so far in ``sweep_dir`` (last record per job number wins)."""
    path = Path(sweep_dir) / JOBS_FILE
    if not path.is_file():
        return []
    rows: dict[int, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            rows[int(row["job"])] = row
    return [rows[k] for k in sorted(rows)]


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover - hydra is a dependency
    _HydraCallback = object  # type: ignore[assignment,misc]


class SweepSummary(_HydraCallback):  # type: ignore[misc]
    """Hydra callback: records every job's outcome and summarises the sweep at its end."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Write ``<sweep dir>/sweep.json``: the command line's overrides and the keys the
        sweep varies (:func:`varying_keys`), which name the jobs' MLflow runs."""
        hydra_cfg = config.hydra
        overrides = list(hydra_cfg.overrides.task)
        params = hydra_cfg.sweeper.get("params") or {}
        _write_json(Path(hydra_cfg.sweep.dir) / SWEEP_FILE,
                    {"overrides": overrides,
                     "varying": varying_keys(overrides, {str(k): str(v)
                                                         for k, v in params.items()})})

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if not is_multirun():
            return
        from hydra.core.hydra_config import HydraConfig
        from hydra.core.utils import JobStatus

        hc = HydraConfig.get()
        job_dir = Path(hc.runtime.output_dir)
        failed = job_dir / FAILED_FILE
        killed = job_dir / KILLED_FILE
        value = job_return.return_value if job_return.status == JobStatus.COMPLETED else None
        row: dict[str, Any] = {"job": int(hc.job.num), "overrides": list(hc.overrides.task),
                               "dir": str(job_dir)}
        # a job folder run again (resume) may hold both: the newer one is this run's
        killed_last = killed.is_file() and (
            not failed.is_file() or killed.stat().st_mtime >= failed.stat().st_mtime)
        if killed_last and value is None:
            info = json.loads(killed.read_text())
            row.update(status="killed", error=f"stopped by {info['signal']}; {info['saved']}",
                       resume=info["resume"])
        elif failed.is_file():
            info = json.loads(failed.read_text())
            row.update(status="failed", error=f"{info['error_type']}: {info['error']}")
        elif job_return.status != JobStatus.COMPLETED:  # raised past saopd.train.app
            row.update(status="failed", error=repr(getattr(job_return, "_return_value", None)))
        else:
            row["status"] = "ok"
            if isinstance(value, dict):
                row["run_id"] = value.get("run_id")
                row["metrics"] = {k: v for k, v in value.get("metrics", {}).items()
                                  if k in ("train/loss", "train/flmr", "train/filtered_ratio")}
        _append_line(Path(hc.sweep.dir) / JOBS_FILE, row)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        jobs = read_jobs(sweep_dir)
        failed = [j for j in jobs if j["status"] not in ("ok", "killed")]
        killed = [j for j in jobs if j["status"] == "killed"]
        summary = {"sweep_dir": str(sweep_dir.resolve()), "jobs": len(jobs),
                   "failed": len(failed), "killed": len(killed), "job_outcomes": jobs}
        tmp = sweep_dir / (SUMMARY_FILE + ".tmp")
        sweep_dir.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, sweep_dir / SUMMARY_FILE)
        ok = len(jobs) - len(failed) - len(killed)
        lines = [f"sweep {sweep_dir}: {ok} of {len(jobs)} jobs ok"]
        for j in jobs:
            tail = f"  {j['error']}" if j["status"] != "ok" else ""
            lines.append(f"  #{j['job']:<3} {j['status']:<6} {' '.join(j['overrides'])}{tail}")
            if j.get("resume"):
                lines.append(f"       continue it: {j['resume']}")
        print("\n".join(lines), flush=True)
        status = "FAILED" if failed else "KILLED" if killed else "FINISHED"
        for parent in parent_runs(sweep_dir):
            try:
                end_parent_run(parent["tracking_uri"], parent["run_id"], status=status,
                               tags={"jobs": str(len(jobs)), "failed": str(len(failed)),
                                     "killed": str(len(killed))})
            except Exception as err:  # the summary is written; the parent's status is cosmetic
                log.warning("could not end the sweep's MLflow parent run %s: %s",
                            parent["run_id"], err)
        if failed or killed:
            # Hydra turns a callback's exceptions into warnings; SystemExit gets through and
            # makes the sweep's exit status 1 (after every job has run)
            what = [f"{len(failed)} of {len(jobs)} sweep jobs failed"] if failed else []
            what += [f"{len(killed)} of {len(jobs)} were killed (each one's command to "
                     "continue it is in the summary)"] if killed else []
            raise SystemExit(f"saopd-train: {' and '.join(what)} (see "
                             f"{sweep_dir / SUMMARY_FILE}); the others completed")
