"""Reading training and evaluation runs back from MLflow into pandas frames.

One row per run (:func:`load_runs`), in the column layout of ``mlflow.search_runs``:
``run_id``, ``run_name``, ``experiment``, ``status``, ``start_time`` plus ``params.<key>``,
``tags.<key>`` and ``metrics.<key>`` (the latest value of each metric, i.e. the value at its
highest step). A sweep's parent run (tag ``saopd.sweep_parent``) is never one of them: its jobs
are. Runs are chosen by experiment name(s), tags (``study=...``, ``sweep=...``, the
run tags ``filter``/``objective``/``seed`` that ``saopd-train`` sets) and/or run ids.

A run's *method* (a row of the paper's tables) comes from :func:`method_labels`: the run's
``method`` tag when set (``logger.tags.method=...``), else a name from its filter and objective
(``filter=none, objective=sampled`` -> ``OPD``, ``sa_opd`` -> ``SA-OPD``, ...: the ``label`` of
the registered filter or objective class, :func:`filter_label`, :func:`objective_label`) with the
``filter.*``/``objective.*`` params that differ between runs of that name appended, so that
``SA-OPD (beta_max=0.018)`` and ``SA-OPD (beta_max=None)`` stay apart, and so does every other
param that changes training (``optim.lr=0.5``, ``data.path=...``, ``steps=...``: everything but
the seed and the bookkeeping in :data:`NOT_HYPERPARAMETERS`). Runs of one method that differ only
in the seed are its seeds.

Scores: every metric ``eval/<benchmark>/avg_at_<k>`` (what ``saopd-eval`` and the training's
``EvalCallback`` log, as fractions in [0, 1]) is one benchmark column (:func:`benchmark_columns`;
headers and order from the benchmark records); the value used is the run's latest (highest-step)
one. The labels and orders live on the registered classes and records, so a new filter,
objective or benchmark shows in the tables with no edit here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from saopd.paths import default_tracking_uri
from saopd.runs.ui import SWEEP_PARENT_TAG

__all__ = [
    "BASELINE_LABEL",
    "UNFINISHED",
    "BenchmarkColumn",
    "NoRunsError",
    "RunQuery",
    "benchmark_columns",
    "benchmark_label",
    "column_label",
    "download_token_records",
    "filter_label",
    "is_hyperparameter",
    "load_runs",
    "method_labels",
    "method_name",
    "method_order",
    "metric_histories",
    "mlflow_client",
    "objective_label",
    "resolve_tracking_uri",
    "run_seeds",
    "short_values",
    "unfinished_runs",
]

EVAL_METRIC = re.compile(r"^eval/(?P<bench>[^/]+)/avg_at_(?P<k>\d+)$")
BASELINE_LABEL = "OPD"
"""The label of vanilla OPD (``filter=none``, ``objective=sampled``): the gain column's base."""


def _own(cls: type, attr: str) -> Any:
    """``attr`` as the registered class itself declares it (None when only inherited)."""
    return vars(cls).get(attr)


def filter_label(name: str) -> str | None:
    """The table name of the registered filter ``name`` (its class's ``label``), None for the
    ``none`` filter (the objective names the row); the name itself when the filter has no label
    or is not registered (runs of a filter saopd no longer has)."""
    from saopd.filters import FILTERS

    if name == "none":
        return None
    return (_own(FILTERS.get(name), "label") or name) if name in FILTERS else name


def objective_label(name: str) -> str | None:
    """The table name of the registered objective ``name`` (its class's ``label``), None for
    ``sampled`` (vanilla OPD's estimator); the name itself when unlabelled or unknown."""
    from saopd.objectives import OBJECTIVES

    if name == "sampled":
        return None
    return (_own(OBJECTIVES.get(name), "label") or name) if name in OBJECTIVES else name


def method_order() -> tuple[str, ...]:
    """Row order of the paper's Tables 2 and 3: :data:`BASELINE_LABEL` first, then every
    registered filter and standalone objective with a ``table_order`` (baselines, ablations,
    SA-OPD last), by that order, as the classes declare them."""
    from saopd.filters import FILTERS
    from saopd.objectives import OBJECTIVES

    rows = [cls for registry in (FILTERS, OBJECTIVES) for cls in map(registry.get, registry)]
    ordered = sorted((_own(c, "table_order"), _own(c, "label") or c.name) for c in rows
                     if _own(c, "table_order") is not None)
    return (BASELINE_LABEL, *(label for _, label in ordered))


def _paper_benchmarks() -> list[Any]:
    from saopd.eval.benchmarks import BENCHMARKS

    return sorted((r for r in map(BENCHMARKS.get, BENCHMARKS) if r.column is not None),
                  key=lambda r: r.column)


def benchmark_label(name: str) -> str:
    """The column header of benchmark ``name``: its record's ``label`` (the name when it has
    none or is not registered)."""
    from saopd.eval.benchmarks import BENCHMARKS

    return (BENCHMARKS.get(name).label or name) if name in BENCHMARKS else name


class NoRunsError(ValueError):
    """No run matched the query, or the runs lack what was asked for (message says which)."""


@dataclass(frozen=True)
class RunQuery:
    """Which runs to read.

    Attributes:
        experiments: MLflow experiment names (all experiments when empty and tags/run ids are
            given).
        tags: ``{tag: value}`` every run must carry (``study``, ``sweep``, ``filter``, ...).
        run_ids: explicit runs: alone, they are the selection; with experiments or tags, the
            runs those select are narrowed to these ids.
        statuses: run statuses kept (``FINISHED``, ``RUNNING``, ``FAILED``, ``KILLED``);
            ``None``: all.
    """

    experiments: tuple[str, ...] = ()
    tags: Mapping[str, str] = field(default_factory=dict)
    run_ids: tuple[str, ...] = ()
    statuses: tuple[str, ...] | None = ("FINISHED", "RUNNING")

    def describe(self) -> str:
        parts = []
        if self.experiments:
            parts.append("experiments " + ", ".join(repr(e) for e in self.experiments))
        if self.tags:
            parts.append("tags " + ", ".join(f"{k}={v}" for k, v in self.tags.items()))
        if self.run_ids:
            parts.append("run ids " + ", ".join(self.run_ids))
        if self.statuses is not None:
            parts.append("status " + "/".join(self.statuses))
        return "; ".join(parts) or "(everything)"


def resolve_tracking_uri(uri: str | None = None) -> str:
    """``uri``, else ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<repo root>/mlflow.db`` (where
    ``saopd-train`` logs by default, :func:`saopd.paths.default_tracking_uri`)."""
    if uri:
        return uri
    return os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()


def mlflow_client(client_or_uri: Any) -> Any:
    """An ``MlflowClient``: ``client_or_uri`` itself, or one on that URI (``None``:
    :func:`resolve_tracking_uri`).

    A ``sqlite:///`` URI must name an existing database: reading runs never creates an empty
    store at a mistyped path (``ValueError`` naming it)."""
    if client_or_uri is None or isinstance(client_or_uri, str):
        from mlflow import MlflowClient

        uri = resolve_tracking_uri(client_or_uri)
        db = uri[len("sqlite:///"):].split("?", 1)[0] if uri.startswith("sqlite:///") else ""
        if db and db != ":memory:" and not Path(db).is_file():
            raise ValueError(f"tracking URI {uri}: no MLflow store at {db} (a typo? saopd-train "
                             f"logs to {default_tracking_uri()} unless told otherwise)")
        return MlflowClient(uri)
    return client_or_uri


def _quote(value: str) -> str:
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise ValueError(f"tag value {value!r} has both quote characters; MLflow cannot filter on it")


def _filter_string(tags: Mapping[str, str]) -> str:
    return " and ".join(f"tags.`{k}` = {_quote(str(v))}" for k, v in tags.items())


def load_runs(client_or_uri: Any, query: RunQuery) -> pd.DataFrame:
    """The runs selected by ``query`` as a frame, one row per run, oldest first.

    ``client_or_uri``: an ``MlflowClient``, a tracking URI, or ``None``
    (:func:`resolve_tracking_uri`). Raises :class:`NoRunsError` naming the query when no run
    matches (and the experiments that exist when a name is unknown).
    """
    from mlflow.entities import ViewType

    client = mlflow_client(client_or_uri)
    if not (query.experiments or query.tags or query.run_ids):
        raise NoRunsError("say which runs: give experiment name(s), tags or run ids")
    experiments = {e.experiment_id: e.name for e in
                   client.search_experiments(view_type=ViewType.ACTIVE_ONLY)}
    if query.experiments:
        by_name = {name: eid for eid, name in experiments.items()}
        unknown = [e for e in query.experiments if e not in by_name]
        if unknown:
            raise NoRunsError(
                f"no MLflow experiment named {', '.join(map(repr, unknown))} in this store; "
                f"experiments: {', '.join(sorted(map(repr, by_name))) or 'none'}")
        ids = [by_name[e] for e in query.experiments]
    else:
        ids = list(experiments)
    runs: list[Any] = []
    if query.experiments or query.tags:
        filter_string = _filter_string(query.tags)
        token = None
        while ids:
            page = client.search_runs(ids, filter_string=filter_string,
                                      run_view_type=ViewType.ACTIVE_ONLY, max_results=1000,
                                      order_by=["attributes.start_time ASC"], page_token=token)
            runs.extend(page)
            token = page.token
            if not token:
                break
        if query.run_ids:
            wanted = set(query.run_ids)
            runs = [r for r in runs if r.info.run_id in wanted]
        # a sweep's parent run holds no results of its own: its jobs are the runs
        runs = [r for r in runs if r.data.tags.get(SWEEP_PARENT_TAG) != "true"]
    else:
        from mlflow.exceptions import MlflowException

        for run_id in query.run_ids:
            try:
                runs.append(client.get_run(run_id))
            except MlflowException as err:
                raise NoRunsError(f"no MLflow run {run_id!r}: {err.message}") from None
    if query.statuses is not None:
        runs = [r for r in runs if r.info.status in query.statuses]
    if not runs:
        uri = getattr(client, "tracking_uri", "?")
        raise NoRunsError(f"no MLflow runs match {query.describe()} (tracking URI {uri})")
    rows = [_run_row(r, experiments.get(r.info.experiment_id, r.info.experiment_id))
            for r in runs]
    frame = pd.DataFrame(rows)
    return frame.sort_values("start_time", kind="stable").reset_index(drop=True)


#: Statuses of runs that did not finish (a run killed with -9 stays RUNNING).
UNFINISHED = ("RUNNING", "FAILED", "KILLED", "SCHEDULED")


def unfinished_runs(client_or_uri: Any, query: RunQuery) -> dict[str, int]:
    """How many runs ``query`` selects, by status (``{}`` when none): what a report that keeps
    only finished runs leaves out."""
    try:
        runs = load_runs(client_or_uri, query)
    except NoRunsError:
        return {}
    return {str(k): int(v) for k, v in runs["status"].value_counts().items()}


def _run_row(run: Any, experiment: str) -> dict[str, Any]:
    info, data = run.info, run.data
    row: dict[str, Any] = {
        "run_id": info.run_id, "run_name": info.run_name, "experiment_id": info.experiment_id,
        "experiment": experiment, "status": info.status,
        "start_time": pd.to_datetime(info.start_time, unit="ms", utc=True),
        "artifact_uri": info.artifact_uri,
    }
    row.update({f"params.{k}": v for k, v in data.params.items()})
    row.update({f"tags.{k}": v for k, v in data.tags.items() if not k.startswith("mlflow.")})
    row.update({f"metrics.{k}": float(v) for k, v in data.metrics.items()})
    return row


def _get(frame: pd.DataFrame, column: str) -> pd.Series:
    if column in frame.columns:
        return frame[column]
    return pd.Series([None] * len(frame), index=frame.index, dtype=object)


def _first(*values: Any) -> Any:
    for v in values:
        if v is not None and not (isinstance(v, float) and pd.isna(v)):
            return v
    return None


def method_name(filter_name: str | None, objective: str | None) -> str:
    """The paper's name for a filter/objective pair (``none``/``sampled`` -> ``OPD``)."""
    f = filter_label(filter_name) if filter_name else None
    objective = objective or "sampled"
    o = objective_label(objective)
    if f is None:
        if _standalone(objective):  # methods that are an objective alone
            return str(o)
        return BASELINE_LABEL if o is None else f"{BASELINE_LABEL} ({o})"
    return f if o is None else f"{f} ({o})"


def _standalone(objective: str) -> bool:
    from saopd.objectives import OBJECTIVES

    return objective in OBJECTIVES and bool(_own(OBJECTIVES.get(objective), "standalone"))


def run_seeds(runs: pd.DataFrame) -> pd.Series:
    """Each run's seed (tag ``seed``, else param ``seed``; ``None`` when neither is set)."""
    tags, params = _get(runs, "tags.seed"), _get(runs, "params.seed")
    return pd.Series([_first(t, p) for t, p in zip(tags, params, strict=True)],
                     index=runs.index, dtype=object)


#: Params that do not change what a run trains: its seed (the seeds of one method are its rows'
#: repeats), where it writes and how it is logged, shown or checkpointed.
NOT_HYPERPARAMETERS = ("seed", "step.seed", "resume", "resume_changes", "experiment_name", "study",
                       "method")
NOT_HYPERPARAMETER_PREFIXES = (
    "paths.", "logger.", "eval.", "hydra.", "resources.", "trainer.progress_bar",
    "trainer.view_every_n_steps", "trainer.checkpoint_every_n_steps",
    "trainer.keep_all_checkpoints",
    # where and on how many devices a step runs: the data-parallel step equals one process's
    "trainer.accelerator", "trainer.devices", "trainer.num_nodes", "trainer.strategy",
    "trainer.process_group_backend", "trainer.activation_checkpointing", "trainer.threads",
    # where the teacher is scored: every backend gives the same log-probs (docs/teacher_scoring.md);
    # teacher_scoring.top_k (an approximation) and teacher_scoring.dtype do change them
    "teacher_scoring.backend", "teacher_scoring.urls", "teacher_scoring.model",
    "teacher_scoring.max_model_len", "teacher_scoring.gpu_memory_utilization",
    "teacher_scoring.kv_cache_gb", "teacher_scoring.enforce_eager",
    "teacher_scoring.tensor_parallel_size", "teacher_scoring.in_process",
    "teacher_scoring.devices", "teacher_scoring.model_dir",
    "teacher_scoring.max_images_per_prompt", "teacher_scoring.startup_timeout",
    "teacher_scoring.request_timeout", "teacher_scoring.max_concurrent_requests")


def _short(column: str) -> str:
    """``params.filter.p1`` -> ``p1`` (a method's own hyperparameter), ``params.optim.lr`` ->
    ``optim.lr``."""
    key = column[len("params."):]
    group, _, rest = key.partition(".")
    return rest if group in ("filter", "objective") and rest else key


def short_values(values: Iterable[Any]) -> dict[str, str]:
    """Each distinct value's text for a label or a legend: a decimal number with the fewest
    significant digits (3 at least) that keep the distinct values apart (an Optuna trial's
    ``0.27491389374623653`` is ``0.275``); other values as they are."""
    texts = sorted({str(v) for v in values})

    def number(text: str) -> float | None:
        if not any(c in text for c in ".eE"):
            return None
        try:
            return float(text)
        except ValueError:
            return None

    numbers = {t: number(t) for t in texts}
    floats = [t for t in texts if numbers[t] is not None]
    for digits in range(3, 18):
        shown = {t: f"{numbers[t]:.{digits}g}" for t in floats}
        if len(set(shown.values())) == len({numbers[t] for t in floats}):
            break
    return {t: shown.get(t, t) if floats else t for t in texts}


def is_hyperparameter(column: str) -> bool:
    """Whether the ``params.<key>`` column is a setting that changes what a run trains."""
    key = column[len("params."):]
    return not (key in NOT_HYPERPARAMETERS or key.startswith(NOT_HYPERPARAMETER_PREFIXES))


def method_labels(runs: pd.DataFrame, *, label_tag: str | None = "method") -> pd.Series:
    """A method label per run (the table's row name); see the module docstring for the rules.

    Args:
        runs: frame from :func:`load_runs`.
        label_tag: a run tag that, when set on a run, is its label verbatim (``None``: never).
    """
    filters = [_first(t, p) for t, p in zip(_get(runs, "tags.filter"),
                                            _get(runs, "params.filter.name"), strict=True)]
    objectives = [_first(t, p) for t, p in zip(_get(runs, "tags.objective"),
                                               _get(runs, "params.objective.name"),
                                               strict=True)]
    base = pd.Series([method_name(f, o) for f, o in zip(filters, objectives, strict=True)],
                     index=runs.index, dtype=object)
    labels = base.copy()
    hyper = [c for c in runs.columns if c.startswith("params.") and is_hyperparameter(c)
             and c not in ("params.filter.name", "params.objective.name")]
    for name, idx in base.groupby(base).groups.items():
        group = runs.loc[idx]
        varying = [c for c in hyper if group[c].astype(str).nunique(dropna=False) > 1]
        if not varying:
            continue
        shown = {c: short_values(group[c]) for c in varying}
        for i in idx:
            parts = [f"{_short(c)}={shown[c][str(runs.at[i, c])]}" for c in varying]
            labels.at[i] = f"{name} ({', '.join(parts)})"
    if label_tag:
        own = _get(runs, f"tags.{label_tag}")
        labels = pd.Series([_first(t, lab) for t, lab in zip(own, labels, strict=True)],
                           index=runs.index, dtype=object)
    return labels


@dataclass(frozen=True)
class BenchmarkColumn:
    """One score column: metric ``eval/<benchmark>/avg_at_<k>``."""

    benchmark: str
    k: int

    @property
    def metric(self) -> str:
        return f"eval/{self.benchmark}/avg_at_{self.k}"

    @property
    def key(self) -> str:
        """``<benchmark>@<k>``, the column's id in score frames and on the command line."""
        return f"{self.benchmark}@{self.k}"


def benchmark_columns(runs: pd.DataFrame,
                      benchmarks: Sequence[str] | None = None) -> list[BenchmarkColumn]:
    """The ``eval/<benchmark>/avg_at_<k>`` metrics present in ``runs``, in table order.

    The paper's benchmarks come in its column order (each record's ``column``,
    :class:`saopd.eval.benchmarks.Benchmark`), others after them, sorted. ``benchmarks`` selects
    and orders them: names (``math500``: every k logged for it) or ``name@k``. Raises
    :class:`NoRunsError` when the runs hold no such metric or a requested benchmark is missing,
    naming what is there.
    """
    found = []
    for col in runs.columns:
        m = EVAL_METRIC.match(col[len("metrics."):]) if col.startswith("metrics.") else None
        if m and runs[col].notna().any():
            found.append(BenchmarkColumn(m["bench"], int(m["k"])))
    if not found:
        names = [f"{n} ({r})" for n, r in zip(runs["run_name"], runs["run_id"], strict=True)] \
            if "run_name" in runs.columns else list(runs["run_id"])
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise NoRunsError(
            f"no eval/<benchmark>/avg_at_<k> metric in any of the {len(runs)} selected "
            f"run(s): {shown}; evaluate them first: saopd-eval run_id=<run> benchmarks=[...]")
    known = [r.name for r in _paper_benchmarks()]
    found.sort(key=lambda c: (known.index(c.benchmark) if c.benchmark in known else len(known),
                              c.benchmark, c.k))
    if benchmarks is None:
        return found
    chosen: list[BenchmarkColumn] = []
    for want in benchmarks:
        name, _, k = want.partition("@")
        hits = [c for c in found if c.benchmark == name and (not k or str(c.k) == k)]
        if not hits:
            have = ", ".join(c.key for c in found)
            raise NoRunsError(f"no run has benchmark {want!r} (metric eval/{name}/avg_at_"
                              f"{k or '<k>'}); the runs have: {have}")
        chosen.extend(h for h in hits if h not in chosen)
    return chosen


def column_label(col: BenchmarkColumn, columns: Sequence[BenchmarkColumn]) -> str:
    """Header text: the paper's name; ``(avg@k)`` added when a benchmark has several k."""
    name = benchmark_label(col.benchmark)
    if sum(c.benchmark == col.benchmark for c in columns) > 1:
        return f"{name} (avg@{col.k})"
    return name


def metric_histories(client_or_uri: Any, run_ids: Iterable[str],
                     keys: Iterable[str]) -> pd.DataFrame:
    """Full histories of metrics ``keys`` for the runs, long format.

    Columns ``run_id``, ``key``, ``step``, ``value``. A key a run never logged is absent for
    that run. When a step was logged twice, the later point (by timestamp) is kept.
    """
    client = mlflow_client(client_or_uri)
    rows = []
    keys = list(keys)
    for run_id in run_ids:
        for key in keys:
            for m in client.get_metric_history(run_id, key):
                rows.append((run_id, key, int(m.step), float(m.value), int(m.timestamp)))
    frame = pd.DataFrame(rows, columns=["run_id", "key", "step", "value", "timestamp"])
    frame = frame.sort_values(["run_id", "key", "step", "timestamp"], kind="stable")
    frame = frame.drop_duplicates(["run_id", "key", "step"], keep="last")
    return frame.drop(columns="timestamp").reset_index(drop=True)


def download_token_records(client_or_uri: Any, run_id: str, dst: str | Path,
                           *, last_only: bool = False) -> list[Path]:
    """Copy a run's ``token_records/`` artifacts (see :mod:`saopd.analysis.token_records`) to
    ``dst``; returns the local files, sorted by step (only the last one with ``last_only``).
    An empty list when the run has none."""
    client = mlflow_client(client_or_uri)
    names = sorted(a.path for a in client.list_artifacts(run_id, "token_records")
                   if not a.is_dir)
    if last_only:
        names = names[-1:]
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    out = []
    for name in names:
        out.append(Path(client.download_artifacts(run_id, name, str(dst))))
    return out
