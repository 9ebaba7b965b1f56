"""The notebooks run top to bottom (nbclient) on one tiny training run's outputs.

The tiny run (experiment=tiny, 3 steps, p1 = p2 = 0.5 so tokens get filtered) also checks what
the notebooks rely on: a token record per step next to the HTML views, logged to MLflow.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.analysis.rendered import md_rows
from tests.conftest import REPO, compose_train

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = REPO / "notebooks"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from saopd.train import train

    tmp = tmp_path_factory.mktemp("tiny")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        return train(compose_train(tmp, "experiment=tiny", "filter.p1=0.5", "filter.p2=0.5"))


def test_notebooks_are_stored_without_outputs() -> None:
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    assert [p.name for p in paths] == ["01_filtered_tokens.ipynb", "02_training_dynamics.ipynb",
                                       "03_token_statistics.ipynb"]
    for path in paths:
        book = nbformat.read(path, as_version=4)
        nbformat.validate(book)
        for cell in book.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, path.name
        tagged = [c for c in book.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{path.name}: one parameters cell"


def test_tiny_run_saves_token_records(tiny_run: dict[str, Any]) -> None:
    import mlflow

    from saopd.analysis.token_records import load_step_records

    out = Path(tiny_run["output_dir"])
    records = load_step_records(out)
    assert [r.step for r in records] == [0, 1, 2]
    assert len(list((out / "token_view").glob("*.html"))) == 3
    last = records[-1]
    n_valid = sum(len(r.response_ids) for r in last.responses)
    assert n_valid == last.stats["n_valid"]  # every response of the batch, valid tokens only
    assert sum(sum(r.filtered) for r in last.responses) == last.stats["n_filtered"] > 0
    assert all(r.a_res is not None and r.tokens for r in last.responses)
    client = mlflow.MlflowClient(tiny_run["tracking_uri"])
    logged = client.list_artifacts(tiny_run["run_id"], "token_records")
    assert sorted(Path(a.path).name for a in logged) == [
        f"step_{s:06d}.jsonl.gz" for s in (0, 1, 2)]


def _execute(name: str, tiny_run: dict[str, Any], tmp_path: Path) -> Any:
    book = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    env = {"SAOPD_RUN_DIR": tiny_run["output_dir"],
           "SAOPD_TRACKING_URI": tiny_run["tracking_uri"],
           "SAOPD_EXPERIMENTS": tiny_run["mlflow_experiment"],
           "SAOPD_REPORT_DIR": str(tmp_path / "figures"),
           "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}
    with pytest.MonkeyPatch.context() as mp:  # the kernel inherits this environment
        for key, value in env.items():
            mp.setenv(key, value)
        mp.delenv("MPLBACKEND", raising=False)
        client = nbclient.NotebookClient(book, timeout=120, kernel_name="python3",
                                         resources={"metadata": {"path": str(tmp_path)}})
        client.execute()
    return book


def _outputs(book: Any, mime: str) -> list[str]:
    found = []
    for cell in book.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if mime in data:
                value = data[mime]
                found.append(value if isinstance(value, str) else json.dumps(value))
    return found


def test_filtered_tokens_notebook(tiny_run: dict[str, Any], tmp_path: Path) -> None:
    book = _execute("01_filtered_tokens", tiny_run, tmp_path)
    pages = [h for h in _outputs(book, "text/html") if 'class="resp annotated"' in h]
    assert len(pages) == 1 and 'class="tok flt ann"' in pages[0] and "&Delta;" in pages[0]
    assert list((tmp_path / "figures").glob("filtered_tokens_step_*.html"))


def test_training_dynamics_notebook(tiny_run: dict[str, Any], tmp_path: Path) -> None:
    book = _execute("02_training_dynamics", tiny_run, tmp_path)
    assert _outputs(book, "image/png")
    assert (tmp_path / "figures" / "training_dynamics.png").stat().st_size > 5_000
    assert any(tiny_run["run_id"] in h for h in _outputs(book, "text/html"))


def test_token_statistics_notebook(tiny_run: dict[str, Any], tmp_path: Path) -> None:
    book = _execute("03_token_statistics", tiny_run, tmp_path)
    md = [m for m in _outputs(book, "text/markdown") if "Content word" in m]
    assert md and "Total" in md_rows(md[0])  # the table has its Total row
    assert (tmp_path / "figures" / "token_statistics.tex").is_file()
    assert os.path.getsize(tmp_path / "figures" / "token_statistics.html") > 0
