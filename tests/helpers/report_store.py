"""A synthetic MLflow store for the report tests: runs as saopd-train and saopd-eval log them.

Scores (fractions) per method and seed; the tests derive every expected number from these.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from tests.helpers.mlflow_store import sqlite_store

EXPERIMENT = "study-x"

# method -> (filter, objective, {seed: {benchmark: score}})
RUNS: dict[str, tuple[str, str, dict[int, dict[str, float]]]] = {
    "OPD": ("none", "sampled", {0: {"math500": 0.60, "aime24": 0.10},
                                1: {"math500": 0.62, "aime24": 0.12},
                                2: {"math500": 0.64, "aime24": 0.08}}),
    "SA-OPD": ("sa_opd", "sampled", {0: {"math500": 0.66, "aime24": 0.12},
                                     1: {"math500": 0.68, "aime24": 0.14},
                                     2: {"math500": 0.71, "aime24": 0.13}}),
    "ExOPD": ("none", "exopd", {0: {"math500": 0.65, "aime24": 0.14}}),
    "TIP": ("tip", "sampled", {0: {"math500": 0.68, "aime24": 0.13}}),
}
STUDENT = {"math500": 0.30, "aime24": 0.01}
K = {"math500": 1, "aime24": 8}


def metric(bench: str) -> str:
    return f"eval/{bench}/avg_at_{K[bench]}"


# the SA-OPD seed-0 run's token record: filtered = " cat" (content word) and "." (punctuation)
RECORD_TOKENS = ["The", " cat", " sat", "."]
RECORD_FILTERED = [False, True, False, True]
DUP_SCORES = (0.50, 0.70)  # study=dup: OPD seed 0 twice; the later run (0.70) counts
DEAD_SCORES = (0.60, 0.10)  # study=dead: finished 0.60, then a later killed (RUNNING) 0.10
LR_SCORES = {"1e-06": 0.30, "0.5": 0.02}  # study=lr: OPD seed 0 at two learning rates


@dataclass
class Store:
    uri: str
    run_ids: dict[tuple[str, int], str] = field(default_factory=dict)
    student_run: str = ""
    failed_run: str = ""
    other_study_run: str = ""
    train_only_run: str = ""
    dup_runs: tuple[str, ...] = ()
    dead_runs: tuple[str, ...] = ()  # study=dead: a finished OPD seed 0, then a killed re-run
    lr_runs: tuple[str, ...] = ()  # study=lr: OPD seed 0 at two learning rates


def _train_metrics(seed: int, flmr0: float) -> list[Metric]:
    now = int(time.time() * 1000)
    out = []
    for step in range(6):
        loss = 1.0 / (step + 1) + 0.01 * seed
        out.append(Metric("train/loss", loss, now + step, step))
        out.append(Metric("train/flmr", flmr0 / (step + 1), now + step, step))
    return out


def _entropy_metrics() -> list[Metric]:
    now = int(time.time() * 1000)
    return [Metric(f"train/entropy_student_{part}", value + 0.01 * step, now + step, step)
            for step in range(6) for part, value in (("filtered", 0.4), ("kept", 1.2))]


def make_store(tmp: Path) -> Store:
    """Runs of experiment ``study-x`` (tag study=x) plus an eval-only student run in ``eval``,
    one FAILED run and one run of another study."""
    uri = sqlite_store(tmp / "mlflow.db")
    client = MlflowClient(uri)
    art = (tmp / "mlartifacts").as_uri()
    exp = client.create_experiment(EXPERIMENT, artifact_location=f"{art}/study-x")
    eval_exp = client.create_experiment("eval", artifact_location=f"{art}/eval")
    store = Store(uri=uri)

    def add(exp_id: str, name: str, tags: dict[str, str], params: dict[str, str],
            metrics: list[Metric], status: str = "FINISHED") -> str:
        run = client.create_run(exp_id, run_name=name, tags=tags)
        client.log_batch(run.info.run_id, metrics=metrics,
                         params=[Param(k, v) for k, v in params.items()])
        client.set_terminated(run.info.run_id, status=status)
        return run.info.run_id

    now = int(time.time() * 1000)
    for method, (flt, obj, seeds) in RUNS.items():
        for seed, scores in seeds.items():
            ms = [Metric(metric(b), v, now, 160) for b, v in scores.items()]
            ms.append(Metric("eval/average", sum(scores.values()) / len(scores), now, 160))
            ms += _train_metrics(seed, 0.0 if flt == "none" else 0.05)
            tags = {"study": "x", "filter": flt, "objective": obj, "seed": str(seed)}
            params = {"filter.name": flt, "objective.name": obj, "seed": str(seed)}
            if flt == "sa_opd":
                params.update({"filter.p1": "0.2", "filter.p2": "0.3"})
            store.run_ids[(method, seed)] = add(exp, f"{method}-s{seed}", tags, params, ms)
    store.student_run = add(eval_exp, "eval-student", {}, {},
                            [Metric(metric(b), v, now, 0) for b, v in STUDENT.items()])
    store.failed_run = add(exp, "crashed", {"study": "x", "filter": "random",
                                            "objective": "sampled", "seed": "0"},
                           {"filter.name": "random"},
                           [Metric(metric("math500"), 0.99, now, 1)], status="FAILED")
    store.other_study_run = add(exp, "other", {"study": "y", "filter": "fire",
                                               "objective": "sampled", "seed": "0",
                                               "method": "FiRe (tagged)"},
                                {"filter.name": "fire"},
                                [Metric(metric("math500"), 0.5, now, 1)])
    store.train_only_run = add(exp, "train-only", {"study": "z", "filter": "sa_opd",
                                                   "objective": "sampled", "seed": "0"},
                               {"filter.name": "sa_opd"},
                               _train_metrics(0, 0.05) + _entropy_metrics())
    dups = []
    for value in DUP_SCORES:
        dups.append(add(exp, "dup", {"study": "dup", "filter": "none", "objective": "sampled",
                                     "seed": "0"}, {"filter.name": "none"},
                        [Metric(metric("math500"), value, now, 1)]))
        time.sleep(0.01)  # distinct start times: the later run is the re-run
    store.dup_runs = tuple(dups)
    dead = []
    for value, status in zip(DEAD_SCORES, ("FINISHED", "RUNNING"), strict=True):
        dead.append(add(exp, "dead", {"study": "dead", "filter": "none", "objective": "sampled",
                                      "seed": "0"}, {"filter.name": "none"},
                        [Metric(metric("math500"), value, now, 1)], status=status))
        time.sleep(0.01)  # the killed run is the later one
    store.dead_runs = tuple(dead)
    store.lr_runs = tuple(
        add(exp, f"lr-{lr}", {"study": "lr", "filter": "none", "objective": "sampled",
                              "seed": "0"}, {"filter.name": "none", "optim.lr": lr},
            [Metric(metric("math500"), value, now, 1)])
        for lr, value in LR_SCORES.items())
    _log_token_record(client, store.run_ids[("SA-OPD", 0)], tmp)
    return store


def _log_token_record(client: MlflowClient, run_id: str, tmp: Path) -> None:
    from saopd.analysis.token_records import (
        ResponseRecord,
        StepRecord,
        record_path,
        save_step_record,
    )

    n = len(RECORD_TOKENS)
    rec = StepRecord(step=5, filter_name="sa_opd", stats={"flmr": 0.5}, responses=[
        ResponseRecord(prompt="Where did the cat sit?", response_ids=list(range(n)),
                       tokens=RECORD_TOKENS, a_full=[0.1, 2.0, -0.2, 1.5], a_res=[0.0] * n,
                       filtered=RECORD_FILTERED, entropy_student=[0.5, 0.1, 2.0, 0.2])])
    path = save_step_record(rec, record_path(tmp / "records", 5))
    client.log_artifact(run_id, str(path), "token_records")
