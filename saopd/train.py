"""``saopd-train``: compose the Hydra config, build everything, train with Lightning.

    saopd-train                                   # the default experiment (testbed), on CPU
    saopd-train experiment=tiny                   # random tiny models, < 1 minute
    saopd-train filter=none                       # vanilla OPD on the same setup
    saopd-train filter.beta_max=0.018 seed=1      # SA-OPD with the adaptive FLMR bound
    saopd-train resume=auto                       # continue the latest run of the experiment
    saopd-train -m filter=sa_opd,none seed=0,1    # a sweep (Hydra multirun)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TypeVar

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig

from saopd.config import register_schema, to_train_config
from saopd.filters import FILTERS
from saopd.lightning.callbacks import EvalCallback
from saopd.lightning.data import PromptDataModule
from saopd.lightning.module import OPDModule
from saopd.lightning.trainer import build_trainer, progress_callback, training_callbacks
from saopd.models.factory import build_models
from saopd.objectives import OBJECTIVES
from saopd.paths import conf_dir, register_resolvers
from saopd.prompts.sources import load_prompts
from saopd.rollout.registry import build_run_engine
from saopd.runs.checkpoints import checkpoint_step
from saopd.runs.folder import NonFiniteError, preemption_requested, training_config
from saopd.runs.logger import run_tracking_uri, start_tracking
from saopd.runs.resume import (
    RunIdentityCallback,
    open_run_folder,
    plan_run,
    read_run_record,
    resume_changes,
)
from saopd.runs.sweeps import is_multirun, record_failed_job, record_killed_job, run_tags
from saopd.runs.tracking import (
    check_tracking_server,
    default_tracking_uri,
    mark_run_killed,
    server_down,
)
from saopd.runs.ui import KEY_CHARTS_VIEW, experiment_url, ui_command
from saopd.scoring.registry import build_scorer
from saopd.scoring.teacher_service import check_servable
from saopd.vllm.client.teacher_server import TeacherServiceError

T = TypeVar("T")

log = logging.getLogger("saopd.train")
CONF_DIR = str(conf_dir())


class UserError(Exception):
    """A problem with the user's configuration or inputs: reported without a traceback."""


def train(cfg: DictConfig, extra_callbacks: list[L.Callback] | None = None) -> dict[str, Any]:
    """Run one training job; returns a summary (paths, MLflow run, final metrics, evaluations).

    Each part comes from its registry or factory: the filter and objective
    (``FILTERS``/``OBJECTIVES.from_config``), the models (:func:`~saopd.models.factory.
    build_models`), the prompts, the rollout engine (:func:`~saopd.rollout.registry.
    build_run_engine`), the teacher-scoring service (:func:`~saopd.scoring.registry.
    build_scorer`), the module (:meth:`OPDModule.from_config`), the MLflow run
    (:func:`~saopd.runs.logger.start_tracking`) and the ``Trainer``. Every error of
    the user's making becomes a :class:`UserError` naming the part. ``extra_callbacks`` are
    added to the Trainer's (profilers, custom logging, fault injection).
    """
    conf = _checked("config", to_train_config, cfg)
    L.seed_everything(conf.seed, workers=True, verbose=False)
    token_filter = _checked("config group 'filter'", FILTERS.from_config, conf.filter)
    objective = _checked("config group 'objective'", OBJECTIVES.from_config, conf.objective)
    _checked("teacher_scoring", check_servable,  # refused before anything is loaded
             {f"filter={conf.filter['name']}": token_filter,
              f"objective={conf.objective['name']}": objective},
             conf.teacher_scoring.backend, conf.teacher_scoring.top_k)
    # the checkpoint (verified), its run folder and whose it is (the run's own, a moved folder,
    # a copy, another run's); a sweep job's resume=auto continues its own folder only
    run_config = training_config(dataclasses.asdict(conf))
    plan = _checked("resume", plan_run, conf, run_config, own_folder_only=is_multirun())
    changes = _checked("resume", resume_changes, plan, conf, run_config)
    zero = int(getattr(rank_zero_only, "rank", 0) or 0) == 0  # every DDP/FSDP rank runs this
    uri = run_tracking_uri(conf, plan) if conf.logger.kind == "mlflow" else None
    if zero:  # MLflow's HTTP retries bounded; a server that does not answer stops the run now
        _checked("logger", check_tracking_server, uri)
    with ExitStack() as held:  # released in reverse: the scorer, the engine, the folder's lock
        held.enter_context(_checked("run", open_run_folder, plan, run_config, changes,
                                    writer=zero))
        _use_threads(conf.trainer.threads)
        started = time.perf_counter()
        pair = _checked("models", build_models, conf)
        contexts = {"choice": conf.teacher_contexts, "pair_kind": pair.vocab.kind,
                    "scored": pair.scored_contexts}
        log.info("models ready in %.1f s; tokenizers: %s", time.perf_counter() - started,
                 pair.vocab.describe(conf.teacher_contexts))
        records, data_counts = _checked("data", load_prompts, conf.data, pair.tokenizer,
                                        pair.processor)
        engine = _checked("rollout", build_run_engine, conf, pair)
        held.callback(_close, engine)  # a vLLM engine frees its model copy (sweeps: 1 process)
        scorer = _checked("teacher_scoring", build_scorer, conf, pair)
        if scorer is not None:
            held.callback(scorer.close)
        module = OPDModule.from_config(conf, pair, token_filter, objective, scorer)
        data = PromptDataModule.from_config(conf, records)
        loggers, run_info = _checked(
            "logger", start_tracking, conf, plan, cfg, changes=changes, data_counts=data_counts,
            params={f"teacher_contexts.{k}": v for k, v in contexts.items() if k != "choice"}
        ) if zero else ([], {})
        progress = progress_callback(conf)
        evals = (_checked("eval", EvalCallback.from_config, conf, plan.folder,
                          progress=progress)
                 if conf.eval.every_n_steps else None)
        trainer = _checked("trainer", build_trainer, conf, plan.folder, loggers=loggers, callbacks=[
            *([progress] if progress else []), *training_callbacks(conf, engine, plan.folder),
            *([evals] if evals else []),
            RunIdentityCallback(plan.identity, run_config), *(extra_callbacks or [])])
        _fit(trainer, module, data, plan.checkpoint, tracking_uri=uri, folder=plan.folder)
    summary = {"output_dir": str(plan.folder), "steps": trainer.global_step, **run_info,
               "last_checkpoint": str(plan.folder / "checkpoints" / "last.ckpt"),
               "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
               "data": data_counts, "teacher_contexts": contexts,
               "eval": {str(step): evals.results[step] for step in sorted(evals.results)}
               if evals else {},
               "seconds": round(time.perf_counter() - started, 1)}
    if trainer.is_global_zero:
        (plan.folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _fit(trainer: L.Trainer, module: OPDModule, data: PromptDataModule,
         checkpoint: Path | None, *, tracking_uri: str | None = None,
         folder: Path | None = None) -> None:
    """``trainer.fit``; a fault of the user's or the machine's met in the loop is a
    :class:`UserError` of one line (the traceback goes to the debug log). A run whose tracking
    server (``tracking_uri``) stopped answering says so, with the last step saved in ``folder``
    and how to continue from it."""
    try:
        trainer.fit(module, datamodule=data, ckpt_path=str(checkpoint) if checkpoint else None)
    except NonFiniteError as err:
        raise UserError(str(err)) from None
    except TeacherServiceError as err:  # a teacher server failed mid-run: say which
        raise UserError(f"teacher_scoring: {err}") from None
    except Exception as err:
        log.debug("training stopped", exc_info=True)
        why = server_down(tracking_uri)
        if why is not None and folder is not None:
            raise UserError(
                f"logger: MLflow tracking server {tracking_uri} stopped answering ({why}) "
                f"after {trainer.global_step} steps; {saved_step(folder)}: once the server "
                f"answers again, continue with saopd-train resume={folder} (or resume=auto "
                "if it is the experiment's latest run)") from None
        if isinstance(err, ValueError | OSError):  # a full disk, a checkpoint refused on load
            raise UserError(f"training stopped after {trainer.global_step} steps: {err}"
                            ) from None
        raise


def saved_step(folder: Path) -> str:
    """Which step of run ``folder`` is saved: ``"step 5 is saved in <file>"``, the file
    ``checkpoints/last.ckpt`` points to, or ``last.ckpt`` itself when a preemption saved the
    step there (its step read from the file, tensors mapped, not loaded); ``"no step is saved
    yet"`` without one."""
    last = folder / "checkpoints" / "last.ckpt"
    if not last.exists():
        return "no step is saved yet"
    target = last.resolve()
    match = re.fullmatch(r"step_(\d+)\.ckpt", target.name)
    if match:
        return f"step {int(match[1])} is saved in {target}"
    step = checkpoint_step(target)
    return (f"step {step} is saved in {last}" if step is not None
            else f"the last saved step is in {last}")


def _use_threads(threads: int | None) -> None:
    """``trainer.threads`` torch threads in this process (and in Lightning's DDP/FSDP
    processes, which set their own unless ``OMP_NUM_THREADS`` is set)."""
    if threads:
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


def _close(engine: Any) -> None:
    close = getattr(engine, "close", None)
    if callable(close):
        close()


def _checked(what: str, build: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``build(*args, **kwargs)``; a ``ValueError``, ``OSError`` or ``ImportError`` (bad input,
    a missing file or package) becomes a :class:`UserError` prefixed ``what:``."""
    try:
        return build(*args, **kwargs)
    except (ValueError, OSError, ImportError) as err:
        raise UserError(f"{what}: {err}") from None


register_schema()
register_resolvers()


def run_job(cfg: DictConfig) -> dict[str, Any] | None:
    """The job of ``saopd-train`` (:func:`saopd.cli.train_app`, a sweep's task function) on
    its composed config; returns the run's summary (None if it failed).

    A single run that fails exits with status 2 (configuration) or re-raises. In a sweep
    (``-m``) a failed job is recorded (``FAILED.json``, a FAILED MLflow run) and the sweep goes
    on; :class:`saopd.runs.sweeps.SweepSummary` reports the failures when the sweep ends. A run
    stopped by ``SIGTERM`` saves its step and exits with status 143, or in a sweep records
    the job as killed (``KILLED.json``, with the command that continues it) and returns, unless
    the launcher preempted it (then it exits 143 and is requeued).
    """
    try:
        summary = train(cfg)
    except SIGTERMException:  # preempted: the step is saved (PreemptionCheckpoint); say so
        _record_stopped_job(cfg)
        print("saopd-train: stopped by SIGTERM; the last step is in checkpoints/last.ckpt: "
              "continue with resume=auto (or resume=<run folder>)", file=sys.stderr)
        if is_multirun() and not preemption_requested():  # killed, not preempted: no requeue
            folder = Path(str(cfg.paths.output_dir))
            info = record_killed_job(folder, saved=saved_step(folder))
            log.warning("sweep job stopped by SIGTERM: %s; continue it with %s", info["saved"],
                        info["resume"])
            return None  # the launcher gets a result; the sweep's summary says 'killed'
        sys.exit(143)
    except Exception as err:
        if is_multirun():
            _record_failed_job(cfg, err)
            return None
        if not isinstance(err, UserError):
            raise
        log.error("%s", err)
        print(f"saopd-train: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(format_summary(summary))
    return summary


def _recorded_run(cfg: DictConfig) -> tuple[str | None, str | None]:
    """The tracking URI and MLflow run id the job folder's record names (None, None when it has
    no readable record: the job stopped before training made its run)."""
    try:
        ident = read_run_record(Path(str(cfg.paths.output_dir)))
    except (OSError, ValueError):
        return None, None
    return (None, None) if ident is None else (ident.tracking_uri, ident.run_id)


def _record_stopped_job(cfg: DictConfig) -> None:
    """Mark a job stopped by SIGTERM as KILLED in MLflow (its run record names the run)."""
    uri, run_id = _recorded_run(cfg)
    if cfg.logger.kind != "mlflow" or uri is None or run_id is None:
        return
    try:
        mark_run_killed(uri, run_id)
    except Exception as mlflow_err:  # the checkpoint is saved; the status is cosmetic
        log.warning("could not mark the stopped run KILLED in MLflow: %s", mlflow_err)


def _record_failed_job(cfg: DictConfig, err: Exception) -> None:
    """A failed sweep job: ``FAILED.json`` and its MLflow run marked (or made) FAILED
    (:func:`saopd.runs.sweeps.record_failed_job`)."""
    uri, run_id = _recorded_run(cfg) if cfg.logger.kind == "mlflow" else (None, None)
    if cfg.logger.kind == "mlflow" and uri is None:
        uri = cfg.logger.tracking_uri or default_tracking_uri(str(cfg.paths.root))
    record_failed_job(Path(str(cfg.paths.output_dir)), err, tracking_uri=uri, run_id=run_id,
                      experiment=cfg.logger.experiment_name or cfg.experiment_name,
                      tags=run_tags(cfg), with_traceback=not isinstance(err, UserError))


def format_summary(summary: dict[str, Any]) -> str:
    """What ``saopd-train`` prints of a run's summary (:func:`train`'s return): steps, folders,
    MLflow run, the last step's metrics and the first and last evaluation."""
    m = summary["metrics"]
    lines = [
        f"saopd-train: {summary['steps']} steps in {summary['seconds']} s",
        f"  outputs:     {summary['output_dir']}",
        f"  checkpoint:  {summary['last_checkpoint']}",
    ]
    if "run_id" in summary:
        uri, exp_id = summary["tracking_uri"], summary.get("mlflow_experiment_id")
        lines.append(f"  MLflow:      {uri} (experiment '{summary['mlflow_experiment']}', run "
                     f"{summary['run_id']})")
        # the experiment's key charts, not MLflow 3's GenAI view (saopd.runs.ui)
        view = KEY_CHARTS_VIEW if exp_id else None
        if uri.startswith(("http://", "https://")):  # a tracking server is its own UI
            lines.append(f"  browse:      {experiment_url(uri, exp_id, view=view)}")
        else:  # the environment's own mlflow: the command works in a fresh shell
            lines += [f"  browse:      {ui_command(uri)}", "               then "
                      f"{experiment_url('http://127.0.0.1:5000', exp_id, view=view)}"]
    shown = ("train/loss", "train/flmr", "train/filtered_ratio", "train/kl",
             "train/response_length", "train/step_time")
    lines.append("  last step:   " + ", ".join(
        f"{k.split('/')[-1]}={m[k]:.4g}" for k in shown if k in m))
    lines += _format_evals(summary.get("eval", {}))
    return "\n".join(lines)


def _format_evals(evals: dict[str, dict[str, float]]) -> list[str]:
    """``held-out`` lines: each metric of the first and the last evaluation of the run (by step
    index; -1 = before the first step), e.g. ``arith/avg_at_4: 0.3825 -> 0.4788``."""
    if not evals:
        return []
    steps = sorted(evals, key=int)
    first, last = steps[0], steps[-1]

    def when(step: str) -> str:
        return "before training" if int(step) < 0 else f"after step {int(step) + 1}"

    if first == last:
        head = f"  held-out ({when(last)}):"
        return [head] + [f"    {k.removeprefix('eval/')} = {v:.4g}"
                         for k, v in evals[last].items()]
    lines = [f"  held-out ({when(first)} -> {when(last)}):"]
    for key, value in evals[last].items():
        before = evals[first].get(key)
        shown = "-" if before is None else f"{before:.4g}"
        lines.append(f"    {key.removeprefix('eval/')}: {shown} -> {value:.4g}")
    return lines


