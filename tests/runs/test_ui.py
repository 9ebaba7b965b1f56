"""saopd's experiments are created as model training, once, whoever wins a creation race; the
UI links open the model-training view (the browser check: integration/test_mlflow_ui_browser)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient

from saopd.runs.ui import (
    EXPERIMENT_KIND_TAG,
    MODEL_TRAINING,
    experiment_url,
    get_or_create_experiment,
)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> MlflowClient:
    """One store for the module (creating a store takes seconds); each test its own names."""
    return MlflowClient(f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}")


def test_created_tagged_and_found_again(client: MlflowClient, tmp_path: Path) -> None:
    location = (tmp_path / "art").as_uri()
    exp_id = get_or_create_experiment(client, "runs", artifact_location=location)
    exp = client.get_experiment(exp_id)
    assert exp.name == "runs" and exp.tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING
    assert exp.artifact_location == location
    assert get_or_create_experiment(client, "runs") == exp_id
    assert [e.name for e in client.search_experiments()].count("runs") == 1


def test_an_existing_experiment_gets_the_kind_unless_it_has_one(client: MlflowClient) -> None:
    plain = client.create_experiment("plain")
    genai = client.create_experiment("genai", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    assert get_or_create_experiment(client, "plain") == plain
    assert client.get_experiment(plain).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING
    assert get_or_create_experiment(client, "genai") == genai
    assert client.get_experiment(genai).tags[EXPERIMENT_KIND_TAG] == "genai_development"


def test_a_deleted_experiment_is_refused_naming_it(client: MlflowClient) -> None:
    exp_id = client.create_experiment("gone")
    client.delete_experiment(exp_id)
    with pytest.raises(ValueError, match=rf"'gone' \(id {exp_id}\) is deleted.*restore"):
        get_or_create_experiment(client, "gone")


class _LateClient(MlflowClient):
    """A real client whose first lookup misses: another process creates the experiment between
    this process's lookup and its create (two sweep jobs starting at once)."""

    def __init__(self, uri: str) -> None:
        super().__init__(uri)
        self.lookups = 0

    def get_experiment_by_name(self, name: str):  # type: ignore[override]
        self.lookups += 1
        if self.lookups == 1:
            MlflowClient(self.tracking_uri).create_experiment(name)  # the other job wins
            return None
        return super().get_experiment_by_name(name)


def test_the_loser_of_a_creation_race_uses_the_winners_experiment(client: MlflowClient) -> None:
    late = _LateClient(client.tracking_uri)
    exp_id = get_or_create_experiment(late, "raced")
    assert late.lookups == 2
    exp = late.get_experiment(exp_id)
    assert exp.name == "raced" and exp.tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING


def test_links_open_the_model_training_view() -> None:
    assert experiment_url("http://127.0.0.1:5000/", "7") == (
        "http://127.0.0.1:5000/#/experiments/7/runs?workflowType=machine_learning"
        "&compareRunsMode=CHART")
    assert experiment_url("http://h:1", "7", charts=False) == (
        "http://h:1/#/experiments/7/runs?workflowType=machine_learning")
    assert experiment_url("http://h:1") == (
        "http://h:1/#/experiments?workflowType=machine_learning")
    with pytest.raises(ValueError, match="http"):
        experiment_url("sqlite:///mlflow.db", "1")


def test_the_printed_mlflow_ui_command_runs_in_a_fresh_shell(tmp_path: Path) -> None:
    import shlex
    import subprocess

    from saopd.runs.ui import ui_command

    uri = f"sqlite:///{tmp_path / 'with space' / 'mlflow.db'}"
    words = shlex.split(ui_command(uri, port=5001))
    assert words[1:] == ["ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port",
                         "5001"]
    assert Path(words[0]).is_absolute()  # not a bare `mlflow` a fresh shell does not find
    fresh = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no venv activated
    out = subprocess.run([words[0], "ui", "--help"], env=fresh, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "--backend-store-uri" in out.stdout, out.stderr[-2000:]


def test_the_link_names_the_stored_view_only_when_asked() -> None:
    from saopd.runs.ui import KEY_CHARTS_VIEW, key_charts_state

    assert experiment_url("http://h:1", "7", view=KEY_CHARTS_VIEW).endswith(
        f"&compareRunsMode=CHART&viewStateShareKey={KEY_CHARTS_VIEW}")
    assert "viewStateShareKey" not in experiment_url("http://h:1", "7", charts=False,
                                                     view=KEY_CHARTS_VIEW)
    state = key_charts_state(["eval/a/avg_at_4", "train/loss"])
    assert [c["metricKey"] for c in state["compareRunCharts"]] == ["eval/a/avg_at_4",
                                                                   "train/loss"]
    assert {c["type"] for c in state["compareRunCharts"]} == {"LINE"}
