"""saopd.analysis.collect: the tables' labels and orders come from the registered classes and
records (a new filter's label shows in saopd-report's table with no edit to saopd.analysis), and
the helpers that name and order rows and columns."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from saopd.analysis.collect import (
    BASELINE_LABEL,
    benchmark_columns,
    benchmark_label,
    column_label,
    filter_label,
    is_hyperparameter,
    method_labels,
    method_name,
    method_order,
    objective_label,
    short_values,
)
from saopd.filters import FILTERS
from saopd.objectives import OBJECTIVES
from tests.analysis.rendered import md_rows

THROWAWAY = "Throwaway Filter"


def _store(tmp: Path) -> str:
    """Runs of vanilla OPD, TIP, SA-OPD and a filter registered only by the report's process."""
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("labels", artifact_location=(tmp / "art").as_uri())
    now = int(time.time() * 1000)
    for i, flt in enumerate(("none", "tip", "sa_opd", "throwaway_test")):
        for seed in (0, 1):
            run = client.create_run(exp, run_name=f"{flt}-{seed}", tags={
                "study": "labels", "filter": flt, "objective": "sampled", "seed": str(seed)})
            client.log_batch(run.info.run_id,
                             metrics=[Metric("eval/math500/avg_at_1", 0.1 * i + 0.01 * seed,
                                             now, 1)],
                             params=[Param("filter.name", flt), Param("seed", str(seed))])
            client.set_terminated(run.info.run_id)
    return uri


REPORT_WITH_A_NEW_FILTER = textwrap.dedent('''
    import sys
    from dataclasses import dataclass

    from saopd.filters import FILTERS, TokenFilter

    @FILTERS.register("throwaway_test")
    @dataclass
    class ThrowawayFilter(TokenFilter):
        """A filter that exists only in this test."""

        label = "{label}"
        table_order = 25  # between FiRe-OPD (20) and TIP (30)

    from saopd.report import main

    main(sys.argv[1:])
''').format(label=THROWAWAY)


def test_a_registered_filters_label_shows_in_the_report_table(tmp_path: Path) -> None:
    uri = _store(tmp_path)
    out = tmp_path / "report"
    env_run = subprocess.run(
        [sys.executable, "-c", REPORT_WITH_A_NEW_FILTER, "--tracking-uri", uri, "-t",
         "study=labels", "--out", str(out), "--log-to", "none"],
        capture_output=True, text=True, timeout=300)
    assert env_run.returncode == 0, env_run.stdout[-2000:] + env_run.stderr[-3000:]
    rows = list(md_rows((out / "results.md").read_text()))
    methods = [r for r in rows if r in (BASELINE_LABEL, "TIP", "SA-OPD", THROWAWAY)]
    assert methods == [BASELINE_LABEL, THROWAWAY, "TIP", "SA-OPD"]  # by table_order
    assert "throwaway_test" not in rows  # the label, not the config name
    assert THROWAWAY not in FILTERS  # registered only in the report's process


def test_labels_come_from_the_registered_classes() -> None:
    assert filter_label("sa_opd") == FILTERS.get("sa_opd").label == "SA-OPD"
    assert filter_label("none") is None
    assert filter_label("gone_filter") == "gone_filter"  # runs of a filter saopd no longer has
    assert objective_label("sampled") is None
    assert objective_label("full_kl") == OBJECTIVES.get("full_kl").label == "full KL"
    assert objective_label("gone") == "gone"
    assert method_name("none", "sampled") == BASELINE_LABEL == "OPD"
    assert method_name("none", None) == "OPD"
    assert method_name("none", "exopd") == "ExOPD"  # a standalone objective names the row
    assert method_name("none", "full_kl") == "OPD (full KL)"
    assert method_name("sa_opd", "topk_kl") == "SA-OPD (top-k KL)"
    assert method_name("ig_only", "sampled") == "Input-Groundedness-only Filter"


def test_method_order_is_the_papers_from_the_classes() -> None:
    assert method_order() == (
        "OPD", "ExOPD", "FiRe-OPD", "TIP", "TA-OPD", "Entropy-Aware OPD", "Random Filter",
        "Divergence-only Filter", "Input-Groundedness-only Filter", "Proxy Replacement",
        "SA-OPD")
    # the positive controls have a label but no place among the methods
    assert FILTERS.get("oracle").label not in method_order()


def test_benchmark_columns_in_the_papers_order_then_by_name() -> None:
    runs = pd.DataFrame({
        "run_id": ["a", "b"], "run_name": ["a", "b"],
        "metrics.eval/zeta/avg_at_1": [0.1, None],
        "metrics.eval/gsm8k/avg_at_8": [0.2, 0.3],
        "metrics.eval/math500/avg_at_1": [0.4, 0.5],
        "metrics.eval/arith/avg_at_1": [0.6, 0.7],
        "metrics.eval/aime24/avg_at_8": [None, None],  # never logged: no column
        "metrics.eval/aime24/avg_at_4": [0.1, 0.2],
        "metrics.eval/aime24/avg_at_16": [0.1, 0.2],
    })
    cols = benchmark_columns(runs)
    assert [c.key for c in cols] == ["math500@1", "aime24@4", "aime24@16", "gsm8k@8",
                                     "arith@1", "zeta@1"]
    assert [column_label(c, cols) for c in cols] == [
        "Math500", "AIME24 (avg@4)", "AIME24 (avg@16)", "GSM8K", "arith", "zeta"]
    assert [c.key for c in benchmark_columns(runs, ["zeta", "aime24@16"])] == ["zeta@1",
                                                                              "aime24@16"]
    assert benchmark_label("minerva_math") == "Minerva" and benchmark_label("nope") == "nope"


def test_labels_keep_runs_apart_by_the_hyperparameters_that_differ() -> None:
    runs = pd.DataFrame({
        "tags.filter": ["sa_opd", "sa_opd", "none", "none"],
        "params.filter.name": ["sa_opd", "sa_opd", "none", "none"],
        "params.filter.p1": ["0.2", "0.4", None, None],
        "params.seed": ["0", "0", "0", "1"],  # the seed never splits a method
        "tags.method": [None, None, None, "Mine"],
    })
    assert method_labels(runs).tolist() == ["SA-OPD (p1=0.2)", "SA-OPD (p1=0.4)", "OPD", "Mine"]
    assert method_labels(runs, label_tag=None).tolist()[3] == "OPD"


def test_hyperparameters_and_short_values() -> None:
    assert is_hyperparameter("params.optim.lr") and is_hyperparameter("params.filter.p1")
    assert not is_hyperparameter("params.seed")
    assert not is_hyperparameter("params.trainer.devices")
    assert not is_hyperparameter("params.teacher_scoring.backend")
    assert short_values(["0.27491389374623653", "0.2751", "abc"]) == {
        "0.27491389374623653": "0.2749", "0.2751": "0.2751", "abc": "abc"}
    assert short_values(["1", "2"]) == {"1": "1", "2": "2"}


@pytest.mark.parametrize("name", ["none", "sa_opd", "random"])
def test_every_filter_with_a_place_has_a_label(name: str) -> None:
    cls = FILTERS.get(name)
    assert (vars(cls).get("table_order") is None) == (name == "none")
    assert (vars(cls).get("label") is None) == (name == "none")
