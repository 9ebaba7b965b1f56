"""Putting a report together: score frames, output files, and logging them to MLflow.

Shared by ``saopd-report`` (:mod:`saopd.report`) and the notebooks. Where the report goes in
MLflow: a *report run* of its own (experiment ``reports`` by default) holds every file under
``report/``, tagged with what was selected (``saopd.report.query``) and listing the source runs
in ``report/sources.csv``, so the training runs stay as training wrote them and a report can be
regenerated or compared with an older one. Optionally (``log_to_runs``) each training run also
gets its own training-dynamics figure under ``report/``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from saopd.analysis.collect import mlflow_client
from saopd.analysis.tables import ResultsTable
from saopd.runs.ui import get_or_create_experiment

__all__ = [
    "REPORT_ARTIFACT_DIR",
    "REPORT_TAG",
    "ensure_experiment",
    "log_files_to_run",
    "log_report_run",
    "scores_frame",
    "slug",
    "write_table_files",
]

REPORT_ARTIFACT_DIR = "report"
REPORT_TAG = "saopd.report"


def slug(text: str) -> str:
    """A file-name-safe version of a label (``SA-OPD (beta_max=0.018)`` ->
    ``sa-opd_beta_max_0.018``)."""
    s = re.sub(r"[^\w.\-]+", "_", text.strip().lower()).strip("._")
    return s or "unnamed"


def scores_frame(runs: pd.DataFrame, metrics: Iterable[str]) -> pd.DataFrame:
    """Per-run scores: index = run id, one column per metric (``eval/<bench>/avg_at_<k>``),
    NaN where a run lacks one."""
    cols = {m: runs[f"metrics.{m}"] if f"metrics.{m}" in runs.columns
            else pd.Series(float("nan"), index=runs.index) for m in metrics}
    frame = pd.DataFrame(cols)
    frame.index = pd.Index(runs["run_id"], name="run_id")
    return frame.astype(float)


def write_table_files(table: ResultsTable, out_dir: str | Path, *, stem: str = "results",
                      title: str | None = None) -> dict[str, Path]:
    """Write the table as ``<stem>.md``, ``<stem>.tex`` and ``<stem>.html`` in ``out_dir``;
    returns ``{"markdown": path, "latex": path, "html": path}``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"markdown": out / f"{stem}.md", "latex": out / f"{stem}.tex",
             "html": out / f"{stem}.html"}
    files["markdown"].write_text(table.to_markdown(), encoding="utf-8")
    files["latex"].write_text(table.to_latex(label=f"tab:{slug(stem)}"), encoding="utf-8")
    files["html"].write_text(table.to_html(title=title), encoding="utf-8")
    return files


def _sqlite_dir(uri: str) -> Path | None:
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return None
    rest = uri[len(prefix):].split("?", 1)[0]
    return Path(rest).parent if rest and rest != ":memory:" else None


def ensure_experiment(client_or_uri: Any, name: str) -> str:
    """The id of MLflow experiment ``name``, created if missing. In a local SQLite store its
    artifacts go to ``<store folder>/mlartifacts/<name>``, as for training experiments
    (:func:`saopd.runs.mlflow_logger.make_mlflow_logger`), tagged as model training
    (:func:`saopd.runs.ui.get_or_create_experiment`; a deleted one is refused)."""
    client = mlflow_client(client_or_uri)
    folder = _sqlite_dir(getattr(client, "tracking_uri", ""))
    location = None
    if folder is not None:
        location = (folder.resolve() / "mlartifacts" / slug(name)).as_uri()
    return get_or_create_experiment(client, name, artifact_location=location)


def log_files_to_run(client_or_uri: Any, run_id: str, files: Iterable[Path],
                     artifact_dir: str = REPORT_ARTIFACT_DIR) -> None:
    """Log local files as artifacts ``<artifact_dir>/<name>`` of an existing run."""
    client = mlflow_client(client_or_uri)
    for path in files:
        client.log_artifact(run_id, str(path), artifact_dir)


def log_report_run(client_or_uri: Any, files: Iterable[Path], *, experiment: str = "reports",
                   run_name: str | None = None, tags: Mapping[str, str] | None = None,
                   sources: pd.DataFrame | None = None) -> str:
    """Create a finished report run in ``experiment`` holding ``files`` under ``report/``.

    ``sources`` (run ids and labels) is saved as ``report/sources.csv``. Returns the run id.
    """
    import tempfile

    client = mlflow_client(client_or_uri)
    exp_id = ensure_experiment(client, experiment)
    all_tags = {REPORT_TAG: "true", **dict(tags or {})}
    run = client.create_run(exp_id, run_name=run_name, tags=all_tags)
    run_id = run.info.run_id
    try:
        log_files_to_run(client, run_id, files)
        if sources is not None:
            with tempfile.TemporaryDirectory(prefix="saopd-report-") as tmp:
                path = Path(tmp) / "sources.csv"
                sources.to_csv(path, index=False)
                client.log_artifact(run_id, str(path), REPORT_ARTIFACT_DIR)
    except Exception:
        client.set_terminated(run_id, status="FAILED")
        raise
    client.set_terminated(run_id)
    return run_id
