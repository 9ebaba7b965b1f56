"""saopd-report against a temporary SQLite MLflow store of synthetic runs (report_store.py)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pandas as pd
import pytest
from mlflow import MlflowClient

from saopd.analysis.collect import (
    NoRunsError,
    RunQuery,
    benchmark_columns,
    load_runs,
    method_labels,
    resolve_tracking_uri,
)
from saopd.report import main
from tests.analysis.rendered import md_rows
from tests.helpers.report_store import (
    DEAD_SCORES,
    DUP_SCORES,
    EXPERIMENT,
    LR_SCORES,
    RUNS,
    STUDENT,
    K,
    Store,
    make_store,
    metric,
)


@pytest.fixture(scope="module", autouse=True)
def _quiet_mlflow():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        yield


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    return make_store(tmp_path_factory.mktemp("store"))


def _cells(markdown: str, row: str) -> list[str]:
    return md_rows(markdown)[row]


def _value(cell: str) -> str:
    """A table cell without its best (bold) / second-best (underlined) marks."""
    return cell.replace("<u>", "").replace("</u>", "").strip("*")


def _mean(method: str, bench: str) -> float:
    return statistics.mean(100 * s[bench] for s in RUNS[method][2].values())


def _avg(method: str) -> list[float]:
    return [statistics.mean(100 * v for v in s.values()) for s in RUNS[method][2].values()]


# ---- reading runs -----------------------------------------------------------------------------

def test_runs_by_experiment_tags_and_status(store: Store) -> None:
    n_methods = sum(len(seeds) for _, _, seeds in RUNS.values())
    runs = load_runs(store.uri, RunQuery(experiments=(EXPERIMENT,), tags={"study": "x"}))
    assert len(runs) == n_methods and store.failed_run not in set(runs["run_id"])
    every = load_runs(store.uri, RunQuery(tags={"study": "x"}, statuses=None))
    assert store.failed_run in set(every["run_id"]) and len(every) == n_methods + 1
    one = load_runs(store.uri, RunQuery(run_ids=(store.student_run,)))
    assert one["experiment"].tolist() == ["eval"]
    labels = method_labels(runs)
    expected = {rid: m for (m, _), rid in store.run_ids.items()}
    assert dict(zip(runs["run_id"], labels, strict=True)) == expected
    tagged = load_runs(store.uri, RunQuery(tags={"study": "y"}))
    assert method_labels(tagged).tolist() == ["FiRe (tagged)"]
    assert method_labels(tagged, label_tag=None).tolist() == ["FiRe-OPD"]
    assert [c.key for c in benchmark_columns(runs)] == [f"math500@{K['math500']}",
                                                         f"aime24@{K['aime24']}"]


def test_query_errors_name_the_problem(store: Store) -> None:
    with pytest.raises(NoRunsError, match=r"no MLflow experiment named 'nope'.*study-x"):
        load_runs(store.uri, RunQuery(experiments=("nope",)))
    with pytest.raises(NoRunsError, match="study=none-such"):
        load_runs(store.uri, RunQuery(tags={"study": "none-such"}))
    with pytest.raises(NoRunsError, match="say which runs"):
        load_runs(store.uri, RunQuery())
    runs = load_runs(store.uri, RunQuery(tags={"study": "z"}))
    with pytest.raises(NoRunsError, match="no eval/<benchmark>/avg_at_<k> metric"):
        benchmark_columns(runs)
    runs = load_runs(store.uri, RunQuery(tags={"study": "x"}))
    with pytest.raises(NoRunsError, match=r"'gsm8k'.*math500@1"):
        benchmark_columns(runs, ["gsm8k"])


def test_labels_keep_apart_runs_whose_hyperparameters_differ() -> None:
    runs = pd.DataFrame({
        "run_id": ["a", "b", "c"], "tags.filter": ["sa_opd", "sa_opd", "none"],
        "tags.objective": ["sampled", "sampled", "exopd"],
        "params.filter.beta_max": ["0.018", "None", None], "params.filter.p1": ["0.2"] * 3})
    assert method_labels(runs).tolist() == ["SA-OPD (beta_max=0.018)", "SA-OPD (beta_max=None)",
                                            "ExOPD"]


def test_default_tracking_uri_matches_training(monkeypatch: pytest.MonkeyPatch) -> None:
    from saopd.paths import repo_root
    from saopd.runs.tracking import default_tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri() == default_tracking_uri(repo_root())
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///x.db")
    assert resolve_tracking_uri() == "sqlite:///x.db"
    assert resolve_tracking_uri("http://h:5000") == "http://h:5000"


# ---- the command line, end to end -------------------------------------------------------------

def test_cli_end_to_end(store: Store, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "report"
    main(["--tracking-uri", store.uri, "-e", EXPERIMENT, "-t", "study=x",
          "--reference", f"Student={store.student_run}", "--out", str(out),
          "--token-records", "--spread", "std", "--marks", "rank", "--decimals", "1",
          "--log-to", "report"])
    printed = capsys.readouterr().out
    for name in ("results.md", "results.tex", "results.html", "training_dynamics.png",
                 "sources.csv", "report.json", "token_statistics_sa-opd.md",
                 "token_statistics_sa-opd.tex", "token_statistics_sa-opd.html",
                 "entropy_sa-opd.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name

    md = (out / "results.md").read_text()
    assert md in printed
    header = _cells(md, "Method")
    assert header[:4] == ["Method", "Math500", "AIME24", "Avg."]
    sa, opd = _cells(md, "SA-OPD"), _cells(md, "OPD")
    sd = statistics.stdev(100 * s["math500"] for s in RUNS["SA-OPD"][2].values())
    assert sa[1] == f"**{_mean('SA-OPD', 'math500'):.1f} ± {sd:.1f}**"
    assert opd[3].startswith(f"{statistics.mean(_avg('OPD')):.1f} ± ")
    gain = statistics.mean(_avg("SA-OPD")) - statistics.mean(_avg("OPD"))
    assert sa[4] == f"{gain:+.1f}" and sa[5] == str(len(RUNS["SA-OPD"][2]))
    student = _cells(md, "Student")
    assert student[1] == f"{100 * STUDENT['math500']:.1f}" and "**" not in student[1]
    assert _cells(md, "ExOPD")[2] == f"**{_mean('ExOPD', 'aime24'):.1f}**"

    sources = pd.read_csv(out / "sources.csv")
    assert set(sources["run_id"]) == set(store.run_ids.values()) | {store.student_run}
    assert sources.loc[sources["run_id"] == store.student_run, "label"].item() == "Student"

    stats_md = (out / "token_statistics_sa-opd.md").read_text()
    assert _cells(stats_md, "Content word")[1:3] == ["1", "50.0%"]  # " cat" of 2 filtered
    assert _cells(stats_md, "Punctuation / format")[1:3] == ["1", "50.0%"]

    client = MlflowClient(store.uri)
    exp = client.get_experiment_by_name("reports")
    report = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])[0]
    assert report.info.status == "FINISHED" and report.data.tags["saopd.report"] == "true"
    logged = {Path(a.path).name for a in client.list_artifacts(report.info.run_id, "report")}
    assert {"results.md", "results.tex", "results.html", "training_dynamics.png",
            "sources.csv"} <= logged
    store_dir = Path(store.uri.removeprefix("sqlite:///")).parent
    assert exp.artifact_location == (store_dir.resolve() / "mlartifacts" / "reports").as_uri()


def test_cli_keeps_the_later_of_two_runs_of_one_method_and_seed(
        store: Store, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    main(["--tracking-uri", store.uri, "-t", "study=dup", "--out", str(tmp_path / "d"),
          "--log-to", "none"])
    captured = capsys.readouterr()
    md = (tmp_path / "d" / "results.md").read_text()
    # the later run of seed 0 (the only method row, so also the best)
    # one seed, one method: no interval separates it (the default marks), so no bold
    assert _cells(md, "OPD")[1] == f"{100 * DUP_SCORES[-1]:.1f}"
    assert f"run {store.dup_runs[0]}" in captured.err and "replaced" in captured.err
    assert "training dynamics figure skipped: no selected run logged train/flmr" in captured.err


def test_cli_figures_only_and_errors(store: Store, tmp_path: Path,
                                     capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--tracking-uri", store.uri, "-t", "study=z", "--out", str(tmp_path / "z"),
              "--log-to", "none"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "no eval/<benchmark>/avg_at_<k> metric" in err and "--no-table" in err

    main(["--tracking-uri", store.uri, "-t", "study=z", "--out", str(tmp_path / "z"),
          "--log-to", "runs", "--no-table"])
    assert (tmp_path / "z" / "training_dynamics.png").is_file()
    assert (tmp_path / "z" / "entropy_over_steps.png").is_file()  # the run logged both metrics
    assert not (tmp_path / "z" / "results.md").exists()
    # --log-to runs: the training run got its own figure under report/
    names = [a.path for a in MlflowClient(store.uri).list_artifacts(store.train_only_run,
                                                                     "report")]
    assert len(names) == 1 and names[0].endswith(".png")

    for argv, message in (
        (["-e", "nope"], "no MLflow experiment named 'nope'"),
        (["-t", "study=x", "--benchmarks", "gsm8k"], "no run has benchmark 'gsm8k'"),
        (["-t", "study=z", "--no-table", "--token-records"], "none of the selected runs has "
                                                              "token records"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["--tracking-uri", store.uri, "--out", str(tmp_path / "e"), "--log-to", "none",
                  *argv])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err, argv
    with pytest.raises(SystemExit):
        main(["-t", "study"])  # argparse: KEY=VALUE expected
    assert "expected KEY=VALUE" in capsys.readouterr().err
    assert metric("math500") == f"eval/math500/avg_at_{K['math500']}"


def test_default_output_folder_is_under_the_repository(store: Store, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # started from another directory, with SAOPD_ROOT naming a (stand-in) repository: the
    # report goes to <repo>/outputs/reports/<time>, nothing into the working directory
    repo, cwd = tmp_path / "repo", tmp_path / "elsewhere"
    (repo / "conf").mkdir(parents=True)
    (repo / "pyproject.toml").write_text("")
    cwd.mkdir()
    monkeypatch.setenv("SAOPD_ROOT", str(repo))
    monkeypatch.chdir(cwd)
    main(["--tracking-uri", store.uri, "-t", "study=dup", "--log-to", "none"])
    assert [p.name for p in (repo / "outputs" / "reports").iterdir()]
    assert not list(cwd.iterdir())


def test_a_dead_run_never_stands_in_for_a_finished_one(store: Store, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    # a run killed with -9 stays RUNNING: by default it is left out (and said so); with
    # --include-unfinished it is a row of its own, flagged, and does not replace the finished run
    main(["--tracking-uri", store.uri, "-t", "study=dead", "--out", str(tmp_path / "a"),
          "--log-to", "none"])
    md = (tmp_path / "a" / "results.md").read_text()
    assert _cells(md, "OPD")[1] == f"{100 * DEAD_SCORES[0]:.1f}"  # one seed: never bold
    assert "OPD [RUNNING]" not in md
    assert "1 unfinished run(s) left out (1 RUNNING" in capsys.readouterr().err
    main(["--tracking-uri", store.uri, "-t", "study=dead", "--out", str(tmp_path / "b"),
          "--log-to", "none", "--include-unfinished"])
    md = (tmp_path / "b" / "results.md").read_text()
    assert _value(_cells(md, "OPD")[1]) == f"{100 * DEAD_SCORES[0]:.1f}"
    assert _value(_cells(md, "OPD [RUNNING]")[1]) == f"{100 * DEAD_SCORES[1]:.1f}"
    assert "replaced" not in capsys.readouterr().err


def test_runs_that_differ_in_a_hyperparameter_are_separate_rows(
        store: Store, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # two runs of one method and seed at different learning rates are not re-runs of each other
    main(["--tracking-uri", store.uri, "-t", "study=lr", "--out", str(tmp_path / "lr"),
          "--log-to", "none"])
    md = (tmp_path / "lr" / "results.md").read_text()
    for lr, value in LR_SCORES.items():
        assert _value(_cells(md, f"OPD (optim.lr={lr})")[1]) == f"{100 * value:.1f}"
    assert "replaced" not in capsys.readouterr().err


def test_a_mistyped_store_is_refused_and_not_created(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "mlfow.db"
    with pytest.raises(SystemExit) as stop:
        main(["--tracking-uri", f"sqlite:///{missing}", "--out", str(tmp_path / "o")])
    assert stop.value.code == 2
    assert f"no MLflow store at {missing}" in capsys.readouterr().err
    assert not missing.exists()


def test_cli_defaults_are_a_ci_table_an_accuracy_figure_and_no_mlflow_run(
        store: Store, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from mlflow import MlflowClient

    from saopd.analysis.tables import auto_decimals, mean_ci95

    client = MlflowClient(store.uri)
    reports = client.get_experiment_by_name("reports")
    before = len(client.search_runs([reports.experiment_id])) if reports else 0
    out = tmp_path / "defaults"
    main(["--tracking-uri", store.uri, "-e", EXPERIMENT, "-t", "study=x", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "MLflow report run" not in printed
    reports = client.get_experiment_by_name("reports")
    assert (len(client.search_runs([reports.experiment_id])) if reports else 0) == before
    assert (out / "accuracy_over_steps.png").stat().st_size > 0
    md = (out / "results.md").read_text()
    assert "95% confidence interval" in md and "interval over seeds lies above" in md
    mean, half = mean_ci95([100 * s["math500"] for s in RUNS["SA-OPD"][2].values()])
    cell = _cells(md, "SA-OPD")[1].strip("*")
    shown = cell.split(" ± ")[0]
    digits = len(shown.split(".")[1]) if "." in shown else 0
    assert digits <= auto_decimals([half])  # rounded to the intervals, not to 17 digits
    assert cell == f"{mean:.{digits}f} ± {half:.{digits}f}"
