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
"""

from __future__ import annotations

import json
import logging
import os
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from saopd.tracking import mark_run_failed

log = logging.getLogger("saopd.sweeps")
JOBS_FILE = "jobs.jsonl"
SUMMARY_FILE = "sweep_summary.json"
FAILED_FILE = "FAILED.json"
KILLED_FILE = "KILLED.json"


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
    MLflow run ``run_id`` FAILED (:func:`saopd.tracking.mark_run_failed`: one is made in
    ``experiment`` with ``tags`` when the job failed before training made it). An MLflow
    error is a warning: the failure is in ``FAILED.json`` and the log already. Returns what
    ``FAILED.json`` holds."""
    log.error("sweep job failed: %s: %s", type(error).__name__, error,
              exc_info=error if with_traceback else None)
    info = record_job_failure(job_dir, error)
    if tracking_uri is not None:
        try:
            mark_run_failed(tracking_uri, run_id, experiment=experiment, tags=tags,
                            error=info["error"])
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
        if failed or killed:
            # Hydra turns a callback's exceptions into warnings; SystemExit gets through and
            # makes the sweep's exit status 1 (after every job has run)
            what = [f"{len(failed)} of {len(jobs)} sweep jobs failed"] if failed else []
            what += [f"{len(killed)} of {len(jobs)} were killed (each one's command to "
                     "continue it is in the summary)"] if killed else []
            raise SystemExit(f"saopd-train: {' and '.join(what)} (see "
                             f"{sweep_dir / SUMMARY_FILE}); the others completed")
