"""Hyperparameter search with Optuna through Hydra's sweeper: each trial's objective values.

    saopd-train -m hparams_search=sa_opd_testbed          # p1, p2: accuracy up, shortcut down
    saopd-train -m hparams_search=sa_opd experiment=smollm2_gsm8k   # p1, p2: held-out score
    saopd-train -m hparams_search=sa_opd_flmr              # p1, p2, beta_max (FLMR bound)

A ``conf/hparams_search/<name>.yaml`` picks Hydra's Optuna sweeper (``hydra-optuna-sweeper``,
TPE sampler), the search space (``hydra.sweeper.params``), the directions
(``hydra.sweeper.direction``) and, in the callback :class:`SearchObjectives`, the metric of
each direction. Every trial is one ``saopd-train`` job: one run folder and one MLflow run
(tagged ``hparams_search=<name>``, with the sweep and the trial's overrides).

Objective values. The train function returns the run's summary (:func:`saopd.train.train`):
its final metrics and every evaluation on the held-out benchmarks. :func:`objective_values`
reads each metric from the *last* evaluation (the configs evaluate after the last step:
``eval.every_n_steps: ${steps}``), else from the final training metrics.
:meth:`SearchObjectives.on_job_end` hands the values to the sweeper as the job's return value
(one float per direction) and records the trial in ``<sweep dir>/trials.jsonl``; a job that
failed, or lacks a metric, becomes a failed trial with the reason, and the search goes on
(``max_failure_rate: 1.0``). When the search ends, :meth:`SearchObjectives.on_multirun_end`
prints the best point (with two objectives: every Pareto-optimal trial), with each one's MLflow
run and run folder, and saves it in ``<sweep dir>/best.json`` beside Optuna's
``optimization_results.yaml``; a search where no trial completed ends the same way, with no best
point and each trial's error (saopd's Optuna sweeper, :mod:`hydra_plugins.saopd_launchers.
optuna_sweeper`, lets it end). ``hydra.sweeper.n_trials`` below 1 is refused at the start.

Storage and resume. Every config keeps the study in ``<sweep dir>/optuna.db`` (SQLite,
``hydra.sweeper.storage``) under a fixed ``hydra.sweeper.study_name``; ``hydra.sweeper.n_trials``
counts the study's trials, old and new (:func:`resume_plan`). A search that was killed (Ctrl-C,
``kill``, a node lost) continues with the same command and ``hydra.sweep.dir=<its folder>``:
the trials it finished are kept, a trial it left running is marked failed (and its budget run
again), job folders continue after the last one, and the sampler is reseeded so that it does
not propose the first trials again. The command is printed when the search starts.

The held-out problems choose the hyperparameters here: a score reported on the same problems
afterwards is optimistic. Report the chosen point on fresh seeds (and, where the benchmark has
them, other problems).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock
from omegaconf import OmegaConf

from saopd.runs.sweeps import is_multirun
from saopd.runs.ui import console_command

__all__ = ["BEST_FILE", "TRIALS_FILE", "ResumePlan", "SearchObjectives", "best_trials",
           "continue_command", "objective_values", "prepare_sqlite_storage", "resume_plan",
           "tie_line", "train_metric_names", "unlogged_metric"]

TRIALS_FILE = "trials.jsonl"
BEST_FILE = "best.json"
OPTUNA_RESULTS = "optimization_results.yaml"  # written by hydra-optuna-sweeper


@dataclass(frozen=True)
class ResumePlan:
    """What a search finds in its storage before its first trial.

    Attributes:
        finished: trials that ended (complete, failed or pruned): they count against
            ``n_trials``.
        interrupted: trials left RUNNING by a search that was killed, now marked failed.
        to_run: the trials this search runs, ``n_trials`` minus ``finished`` (at least 0).
        next_job: the job number of its first trial (one past every stored trial), so that job
            folders are not reused.
    """

    finished: int
    interrupted: int
    to_run: int
    next_job: int


def resume_plan(study: Any, n_trials: int) -> ResumePlan:
    """Mark the trials of ``study`` (an ``optuna.Study``) that a killed search left RUNNING as
    failed, and say how many of ``n_trials`` are still to run (:class:`ResumePlan`)."""
    import optuna

    trials = study.get_trials(deepcopy=False)
    running = [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    for trial in running:  # nothing runs them now: the process that did is gone
        study._storage.set_trial_state(trial._trial_id, optuna.trial.TrialState.FAIL)
    finished = len(trials) - len(running)
    return ResumePlan(finished=finished, interrupted=len(running),
                      to_run=max(0, n_trials - finished), next_job=len(trials))


def prepare_sqlite_storage(storage: str | None) -> Path | None:
    """Make a ``sqlite:///`` Optuna storage openable; its database file (None for other
    storages).

    Creates the file's folder, Optuna's tables and the schema's version stamp. Optuna 2.10
    stamps a new database's schema version on a connection it never commits, which SQLAlchemy
    2 rolls back: opening the storage then fails (``assert version is not None``). The stamp
    here is committed; a stamped database is left as it is."""
    prefix = "sqlite:///"
    if not storage or not str(storage).startswith(prefix):
        return None
    db = Path(str(storage)[len(prefix):].split("?", 1)[0])
    db.parent.mkdir(parents=True, exist_ok=True)
    import alembic.config
    import alembic.migration
    import alembic.script
    import sqlalchemy
    from optuna.storages._rdb import models
    from optuna.storages._rdb import storage as rdb

    engine = sqlalchemy.create_engine(str(storage))
    quiet = logging.getLogger("alembic")  # its INFO lines ("setup plugin ...") are not ours
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        models.BaseModel.metadata.create_all(engine)
        base = Path(rdb.__file__).parent
        config = alembic.config.Config(str(base / "alembic.ini"))
        config.set_main_option("script_location", str(base / "alembic").replace("%", "%%"))
        script = alembic.script.ScriptDirectory.from_config(config)
        with engine.begin() as conn:  # committed on leaving
            context = alembic.migration.MigrationContext.configure(conn)
            if context.get_current_revision() is None:
                context.stamp(script, script.get_current_head())
    finally:
        quiet.setLevel(level)
        engine.dispose()
    return db


def tie_line(values: Mapping[int, Sequence[float]], best: Sequence[float]) -> str | None:
    """One line when several trials (``{job: values}``, the completed ones) share the best
    ``values``: how many, which jobs, and that the search did not separate them; None when the
    best is one trial's."""
    tied = sorted(job for job, v in values.items() if list(v) == list(best))
    if len(tied) < 2:
        return None
    shown = ", ".join(f"#{j}" for j in tied[:10]) + (" ..." if len(tied) > 10 else "")
    every = " (every completed trial)" if len(tied) == len(values) else ""
    return (f"  tie: {len(tied)} of {len(values)} completed trials{every} share the best value "
            f"{', '.join(f'{v:.4g}' for v in best)} ({shown}); the one shown is the first of "
            "them, not a better point: the objective does not separate these trials")


def objective_values(summary: Mapping[str, Any], metrics: Sequence[str]) -> list[float]:
    """The value of each of ``metrics`` in a run's summary, in order.

    A metric is read from the run's last evaluation (``summary["eval"]``, by step), else from
    its final metrics (``summary["metrics"]``). Raises ``ValueError`` naming a metric that is
    in neither (and the names that are), or whose value is not a finite number.
    """
    evals = summary.get("eval") or {}
    last = evals[max(evals, key=int)] if evals else {}
    final = summary.get("metrics") or {}
    out = []
    for name in metrics:
        value = last.get(name, final.get(name))
        if value is None:
            have = sorted({*last, *final})
            where = (f"the last evaluation (after step {int(max(evals, key=int)) + 1})"
                     if evals else "the run's evaluations (it has none: eval.every_n_steps=0?)")
            raise ValueError(f"hparams search: metric {name!r} is not in {where} nor in the "
                             f"final metrics; the run has: {', '.join(have) or 'nothing'}")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"hparams search: metric {name!r} is {value}")
        out.append(value)
    return out


#: What a training step logs whatever its filter and objective (``train/<name>``): the step's
#: own metrics (saopd.lightning.metrics.STEP_METRICS), the learning rate, the wait for a
#: teacher service and the rollouts' staleness (asynchronous rollouts).
STEP_EXTRAS = ("lr", "teacher_wait", "rollout_staleness")


def train_metric_names(filter_cfg: Mapping[str, Any],
                       objective_cfg: Mapping[str, Any]) -> set[str] | None:
    """The ``train/<name>`` names a trial with this filter and objective could log, or None
    when that cannot be told before training.

    The step's own metrics, and what the filter's statistics and the objective's metrics hold
    on a small synthetic batch (2 x 8 tokens) carrying every optional signal a step may compute
    (residual log-probs, entropies, exact KL, sampler and reference log-probs): a superset of
    what a step logs. None when the filter or objective cannot run on it (one that needs top-k
    lists, or a tokenizer to name its tokens)."""
    import torch

    from saopd.filters.base import FILTERS
    from saopd.lightning.metrics import STEP_METRICS
    from saopd.objectives.base import OBJECTIVES
    from saopd.signals.token_signals import TokenSignals

    gen = torch.Generator().manual_seed(0)

    def logprobs() -> torch.Tensor:
        return -torch.rand(2, 8, generator=gen) * 3.0 - 0.01

    try:
        signals = TokenSignals(
            lp_student=logprobs(), lp_teacher=logprobs(),
            valid=torch.ones(2, 8, dtype=torch.bool), lp_student_res=logprobs(),
            lp_teacher_res=logprobs(), entropy_student=torch.rand(2, 8, generator=gen),
            entropy_teacher=torch.rand(2, 8, generator=gen), kl=torch.rand(2, 8, generator=gen),
            lp_sampler=logprobs(), lp_ref=logprobs(),
            response_ids=torch.randint(5, 50, (2, 8), generator=gen))
        result = FILTERS.from_config(filter_cfg)(signals, generator=gen)
        out = OBJECTIVES.from_config(objective_cfg)(signals, result)
    except Exception:  # needs what a synthetic batch lacks: the trials will tell
        return None
    return {*STEP_METRICS, *STEP_EXTRAS, *result.stats,
            *(k for k in out.metrics if k != "kl_sampled")}  # kl_sampled is logged as kl


def unlogged_metric(metrics: Sequence[str], eval_cfg: Mapping[str, Any],
                    train_names: set[str] | None = None) -> str | None:
    """Why a trial would not log one of the objective ``metrics``; None when each could be
    logged.

    A trial's summary holds two namespaces: ``train/<name>`` (every step) and
    ``eval/<benchmark>/<metric>`` (the held-out evaluation); any other name is refused. An
    evaluation metric is refused when the trial does not evaluate (``eval.every_n_steps`` 0),
    its benchmark is not one of ``eval.benchmarks``, or ``avg_at_<k>`` has another k than
    ``eval.k`` (``eval_cfg``: the experiment's ``eval`` config). A training metric is refused
    when it is not one of ``train_names`` (:func:`train_metric_names`; None: not checked)."""
    every = eval_cfg.get("every_n_steps") or 0
    benchmarks = list(eval_cfg.get("benchmarks") or [])
    k = eval_cfg.get("k")
    for name in metrics:
        parts = name.split("/")
        if parts[0] == "train" and len(parts) == 2:
            if train_names is not None and parts[1] not in train_names:
                return (f"objective metric {name!r}: no trial logs it (the trials log "
                        f"{', '.join('train/' + n for n in sorted(train_names))}, and "
                        "eval/<benchmark>/<metric>)")
            continue
        if parts[0] != "eval" or len(parts) < 3:
            return (f"objective metric {name!r}: a trial reports train/<name> and "
                    "eval/<benchmark>/<metric> metrics only (e.g. train/loss, "
                    "eval/<benchmark>/avg_at_<k>)")
        if not every:
            return (f"objective metric {name!r} comes from the held-out evaluation, but "
                    "eval.every_n_steps=0: no trial would evaluate (set eval.every_n_steps, "
                    "or pick a train/ metric)")
        if parts[1] not in benchmarks:
            return (f"objective metric {name!r}: benchmark {parts[1]!r} is not evaluated "
                    f"(eval.benchmarks={benchmarks})")
        if parts[2].startswith("avg_at_") and k is not None and parts[2] != f"avg_at_{k}":
            return (f"objective metric {name!r}: the trials evaluate avg_at_{k} (eval.k={k})")
    return None


def continue_command(config: Any) -> str:
    """The command that continues this search in its folder: ``saopd-train -m``, the command
    line's overrides (Hydra's and the task's) and ``hydra.sweep.dir=<this search's folder>``,
    shell-quoted, with the ``saopd-train`` beside this Python (so that it works in a fresh
    shell)."""
    import shlex

    hydra_cfg = config.hydra
    hydra_overrides = [o for o in hydra_cfg.overrides.hydra
                       if not str(o).startswith("hydra.sweep.dir=")]
    words = [console_command("saopd-train"), "-m", *map(str, hydra_cfg.overrides.task),
             *map(str, hydra_overrides),
             f"hydra.sweep.dir={Path(str(hydra_cfg.sweep.dir)).absolute()}"]
    return " ".join(shlex.quote(w) for w in words)


def _directions(sweeper: Any) -> list[str]:
    """The sweeper's direction(s) as a list of names (``maximize`` / ``minimize``)."""
    direction = sweeper.get("direction")
    seq = list(direction) if isinstance(direction, Sequence) and not isinstance(
        direction, str) else [direction]
    return [getattr(d, "name", str(d)) for d in seq]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()]


def best_trials(sweep_dir: Path) -> list[dict[str, Any]]:
    """The best trial(s) of a finished search, from Optuna's results and the trials' records.

    One entry per best point (one objective: the best trial; several: each Pareto-optimal
    one), with its ``params``, ``values`` and, from ``trials.jsonl``, the ``job`` number, MLflow
    ``run_id`` and ``output_dir`` of the trial that ran those params. Raises
    ``FileNotFoundError`` when the sweeper wrote no results (the search did not finish).
    """
    results_path = sweep_dir / OPTUNA_RESULTS
    if not results_path.is_file():
        raise FileNotFoundError(f"{results_path}: the search wrote no results")
    results = OmegaConf.to_container(OmegaConf.load(results_path))
    assert isinstance(results, dict)
    if "solutions" in results:
        points = [{"params": s["params"], "values": s["values"]} for s in results["solutions"]]
    else:
        points = [{"params": results["best_params"], "values": [results["best_value"]]}]
    trials = [t for t in _read_jsonl(sweep_dir / TRIALS_FILE) if t.get("status") == "ok"]
    for point in points:
        wanted = {f"{k}={v}" for k, v in point["params"].items()}  # the sweeper's override text
        match = next((t for t in trials if wanted <= set(t["overrides"])), None)
        point.update({k: match.get(k) if match else None
                      for k in ("job", "run_id", "output_dir")})
    return points


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover - hydra is a dependency
    _HydraCallback = object  # type: ignore[assignment,misc]


class SearchObjectives(_HydraCallback):  # type: ignore[misc]
    """Hydra callback of ``conf/hparams_search/*.yaml``: each trial's objective values, and the
    best point when the search ends.

    Args:
        metrics: the metric of each of ``hydra.sweeper.direction``, in the same order (e.g.
            ``[eval/arith/avg_at_4, eval/arith/shortcut]`` with ``[maximize, minimize]``).
    """

    def __init__(self, metrics: Sequence[str]) -> None:
        if isinstance(metrics, str) or not metrics:
            raise ValueError("SearchObjectives: metrics must be a non-empty list of metric "
                             f"names, got {metrics!r}")
        self.metrics = [str(m) for m in metrics]

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        """Refuse (exit 2) a search whose directions and metrics do not pair up, of fewer than
        one trial, or whose trials would not log one of its metrics (:func:`unlogged_metric`,
        training metrics checked against :func:`train_metric_names` of the experiment's
        filter and objective); print the command that continues the search."""
        sweeper = config.hydra.sweeper
        problem = None
        if "optuna" not in str(sweeper.get("_target_", "")).lower():
            problem = ("the hparams_search callback needs Hydra's Optuna sweeper "
                       "(hydra/sweeper=optuna), got " + str(sweeper.get("_target_")))
        else:
            directions = _directions(sweeper)
            n_trials = sweeper.get("n_trials")
            if len(directions) != len(self.metrics):
                problem = (f"hydra.sweeper.direction has {len(directions)} direction(s) "
                           f"{directions} for {len(self.metrics)} metric(s) {self.metrics} "
                           "(hydra.callbacks.search_objectives.metrics): one metric each")
            elif isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
                problem = (f"hydra.sweeper.n_trials={n_trials}: a search needs at least one "
                           "trial (hydra.sweeper.n_trials=20)")
            else:
                filter_cfg = OmegaConf.to_container(config.filter, resolve=True) \
                    if "filter" in config else None
                objective_cfg = OmegaConf.to_container(config.objective, resolve=True) \
                    if "objective" in config else None
                # a search over the filter or objective themselves: the trials tell
                varied = {str(k).split(".")[0] for k in (sweeper.get("params") or {})
                          if str(k) in ("filter", "objective", "method")}
                names = train_metric_names(filter_cfg, objective_cfg) if not varied and \
                    isinstance(filter_cfg, dict) and isinstance(objective_cfg, dict) else None
                problem = unlogged_metric(self.metrics, config.get("eval") or {}, names)
        if problem is not None:
            print(f"saopd-train: error: {problem}", file=sys.stderr, flush=True)
            raise SystemExit(2)  # Hydra turns a callback's exceptions into warnings
        if sweeper.get("storage"):
            print(f"hparams search: study {sweeper.get('study_name')!r} in "
                  f"{sweeper.get('storage')}; if it stops, continue it with: "
                  f"{continue_command(config)}", flush=True)

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        """Replace a finished job's summary by its objective values (the sweeper reads them);
        record the trial; turn a job without them into a failed trial naming why."""
        if not is_multirun():
            return
        from hydra.core.hydra_config import HydraConfig
        from hydra.core.utils import JobStatus

        hc = HydraConfig.get()
        row: dict[str, Any] = {"job": int(hc.job.num), "overrides": list(hc.overrides.task)}
        summary = job_return.return_value if job_return.status == JobStatus.COMPLETED else None
        try:
            if not isinstance(summary, Mapping):  # saopd.train.app returned None: it failed
                raise RuntimeError("the training job failed (see FAILED.json in "
                                   f"{hc.runtime.output_dir})")
            values = objective_values(summary, self.metrics)
        except (ValueError, RuntimeError) as err:
            row.update(status="failed", error=str(err))
            if job_return.status == JobStatus.COMPLETED:
                job_return.status = JobStatus.FAILED
                job_return.return_value = err  # the sweeper marks the trial failed
        else:
            row.update(status="ok", values=dict(zip(self.metrics, values, strict=True)),
                       run_id=summary.get("run_id"), output_dir=summary.get("output_dir"))
            job_return.return_value = values[0] if len(values) == 1 else values
        path = Path(hc.sweep.dir) / TRIALS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock"), path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        """Print the best point(s) and save them in ``<sweep dir>/best.json``; a search where
        no trial completed gets the same file (``best: []``) and a line per failed trial."""
        sweep_dir = Path(config.hydra.sweep.dir)
        trials = _read_jsonl(sweep_dir / TRIALS_FILE)
        failed = sum(t["status"] != "ok" for t in trials)
        try:
            points = best_trials(sweep_dir)
        except FileNotFoundError as err:
            if failed < len(trials) or not trials:  # it stopped before the sweeper's end
                print(f"hparams search: no best point: {err}", flush=True)
                return
            points = []  # every trial failed: the sweeper wrote no results
        directions = _directions(config.hydra.sweeper)
        record = {"sweep_dir": str(sweep_dir.resolve()),
                  "objectives": [{"metric": m, "direction": d}
                                 for m, d in zip(self.metrics, directions, strict=True)],
                  "trials": len(trials), "failed": failed, "best": points}
        sweep_dir.mkdir(parents=True, exist_ok=True)
        tmp = sweep_dir / (BEST_FILE + ".tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, sweep_dir / BEST_FILE)
        goal = ", ".join(f"{d} {m}" for m, d in zip(self.metrics, directions, strict=True))
        lines = [f"hparams search: {len(trials)} trials ({failed} failed) in {sweep_dir}"]
        if not points:
            lines.append(f"  {goal}: no trial completed, so there is no best point")
            lines += [f"  #{t['job']} {' '.join(t['overrides'])}: {t.get('error', '?')}"
                      for t in trials if t["status"] != "ok"]
            lines.append(f"  saved: {sweep_dir / BEST_FILE}")
            print("\n".join(lines), flush=True)
            return
        kind = "best trial" if len(points) == 1 else f"{len(points)} Pareto-optimal trials"
        lines.append(f"  {goal}: {kind}")
        done = {int(t["job"]): [float(t["values"][m]) for m in self.metrics]
                for t in trials if t["status"] == "ok"}
        seen: list[list[float]] = []
        for p in points:  # one line per best value that several trials share
            if list(p["values"]) not in seen:
                seen.append(list(p["values"]))
                tie = tie_line(done, p["values"])
                if tie is not None:
                    lines.append(tie)
        for p in points:
            params = " ".join(f"{k}={_short(v)}" for k, v in p["params"].items())
            values = ", ".join(f"{m}={v:.4g}" for m, v in zip(self.metrics, p["values"],
                                                               strict=True))
            lines.append(f"  #{p['job']} {params} -> {values}")
            lines.append(f"      MLflow run {p['run_id']}, outputs {p['output_dir']}")
        lines.append(f"  saved: {sweep_dir / BEST_FILE} (Optuna's: {OPTUNA_RESULTS})")
        print("\n".join(lines), flush=True)
