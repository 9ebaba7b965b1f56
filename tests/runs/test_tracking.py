"""MLflow helpers against a real SQLite store (one store for the module: creating it takes ~2 s)."""

from __future__ import annotations

import tempfile
import time
import uuid
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("lightning")

from mlflow.entities import Metric  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from saopd.runs.mlflow_logger import (  # noqa: E402
    ResumableMLFlowLogger,
    last_logged_step,
    log_resolved_config,
    log_text_artifact,
    make_mlflow_logger,
)
from saopd.runs.tracking import CONFIG_ARTIFACT, default_tracking_uri, flatten_params  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _no_progress_bars():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        yield


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A fresh SQLite store; its creation time is printed (``pytest -s``)."""
    root = tmp_path_factory.mktemp("mlflow")
    uri = default_tracking_uri(root)
    t0 = time.perf_counter()
    MlflowClient(uri).search_experiments()  # creates the schema
    print(f"\nfresh MLflow sqlite store initialised in {time.perf_counter() - t0:.2f} s")
    return root, uri


def _logger(store: tuple[Path, str], **kwargs) -> ResumableMLFlowLogger:
    root, uri = store
    kwargs.setdefault("experiment_name", "tests")
    kwargs.setdefault("run_name", f"run-{uuid.uuid4().hex[:6]}")
    return make_mlflow_logger(tracking_uri=uri, root=root, **kwargs)


def _download_text(client: MlflowClient, run_id: str, path: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        return Path(client.download_artifacts(run_id, path, tmp)).read_text("utf-8")


def test_default_uri_is_absolute_sqlite(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = default_tracking_uri("out")
    assert uri == f"sqlite:///{(tmp_path / 'out' / 'mlflow.db').as_posix()}"
    assert uri.startswith("sqlite:////")  # three slashes + an absolute path
    with pytest.raises(ValueError, match="file store"):
        make_mlflow_logger(experiment_name="x", tracking_uri="./mlruns", run_name=None,
                           root=tmp_path)
    with pytest.raises(ValueError, match="file store"):
        make_mlflow_logger(experiment_name="x", tracking_uri="file:./mlruns", run_name=None,
                           root=tmp_path)


def test_new_run_tags_and_artifact_root(store):
    root, _ = store
    logger = _logger(store, run_name="named", tags={"method": "sa_opd"})
    run = logger.experiment.get_run(logger.run_id)
    assert run.info.run_name == "named" and run.data.tags["method"] == "sa_opd"
    assert run.info.artifact_uri.startswith((root / "mlartifacts" / "tests").as_uri())


def test_flatten_params():
    cfg = OmegaConf.create({
        "model": {"name": "tiny", "layers": 2},
        "student": "${model.name}",
        "filter": {"name": "sa_opd", "p1": 0.2, "p2": None},
        "ratios": [0.1, 0.2],
        "stages": [{"a": 1}, {"b": [1, 2]}],
        "empty": {},
        "weird+key@x": 1,
        "long": "y" * 7000,
    })
    flat = flatten_params(cfg)
    assert flat["model.name"] == "tiny" and flat["model.layers"] == "2"
    assert flat["student"] == "tiny"  # resolved
    assert flat["filter.p2"] == "None" and flat["ratios"] == "[0.1, 0.2]"
    assert flat["stages.0.a"] == "1" and flat["stages.1.b"] == "[1, 2]"
    assert flat["empty"] == "{}" and flat["weird_key_x"] == "1"
    assert len(flat["long"]) == 6000


def test_resolved_config_params_and_yaml(store):
    logger = _logger(store)
    cfg = OmegaConf.create({
        "model": {"name": "tiny"},
        "student": "${model.name}",
        "sweep": {f"k{i:03d}": i for i in range(250)},  # > 100 params: several batches
        "long": "z" * 7000,
    })
    assert log_resolved_config(logger, cfg) == {}
    client = logger.experiment
    params = client.get_run(logger.run_id).data.params
    assert params["student"] == "tiny" and params["sweep.k249"] == "249"
    assert len(params) == 253 and len(params["long"]) == 6000
    text = _download_text(client, logger.run_id, CONFIG_ARTIFACT)
    assert yaml.safe_load(text) == OmegaConf.to_container(cfg, resolve=True)

    # again with the same config: nothing to do; with a changed value: reported, kept, new yaml
    assert log_resolved_config(logger, cfg) == {}
    cfg.model.name = "bigger"
    changed = log_resolved_config(logger, cfg)
    assert changed == {"model.name": ("tiny", "bigger"), "student": ("tiny", "bigger")}
    assert client.get_run(logger.run_id).data.params["model.name"] == "tiny"
    resumed = _download_text(client, logger.run_id, "config/config.resume-1.yaml")
    assert yaml.safe_load(resumed)["student"] == "bigger"
    assert yaml.safe_load(_download_text(client, logger.run_id, CONFIG_ARTIFACT))["student"] \
        == "tiny"
    assert log_resolved_config(logger, {"other": 1}) == {}  # a plain dict works too
    names = {f.path for f in client.list_artifacts(logger.run_id, "config")}
    assert names == {CONFIG_ARTIFACT, "config/config.resume-1.yaml", "config/config.resume-2.yaml"}

    # Lightning's own hyperparameter logging (save_hyperparameters) goes through the same path
    logger.log_hyperparams({"model": {"name": "tiny"}, "lr": 1e-5})
    assert client.get_run(logger.run_id).data.params["lr"] == "1e-05"


def test_text_artifact_and_temp_cleanup(store, tmp_path, monkeypatch):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    logger = _logger(store)
    page = "<html>ünïcode ↵</html>"
    log_text_artifact(logger, page, "token_view/step_000010.html")
    log_text_artifact(logger, "top", "notes.txt")
    assert list(scratch.iterdir()) == []  # temp dirs removed
    client = logger.experiment
    assert _download_text(client, logger.run_id, "token_view/step_000010.html") == page
    assert _download_text(client, logger.run_id, "notes.txt") == "top"
    with pytest.raises(ValueError, match="relative file path"):
        log_text_artifact(logger, "x", "../escape.txt")


def test_resume_continues_run_without_duplicate_steps(store):
    first = _logger(store)
    for step in range(5):
        first.log_metrics({"train/loss": 10.0 - step, "lr": 0.1}, step=step)
    first.log_metrics({"val/acc": 0.5}, step=2)
    first.finalize("success")
    run_id = first.run_id
    client = first.experiment
    assert client.get_run(run_id).info.status == "FINISHED"
    assert last_logged_step(first, "train/loss") == 4
    assert last_logged_step(first, "never/logged") is None

    # resume from a checkpoint at step 2: steps 3, 4 are replayed, 5, 6 are new
    second = _logger(store, run_id=run_id, experiment_name="ignored-on-resume")
    assert second.run_id == run_id
    assert client.get_run(run_id).info.status == "RUNNING"
    for step in range(3, 7):
        second.log_metrics({"train/loss": 100.0 + step, "val/acc": 0.9}, step=step)
    second.finalize("success")

    history = client.get_metric_history(run_id, "train/loss")
    steps = sorted(m.step for m in history)
    assert steps == [0, 1, 2, 3, 4, 5, 6]  # each step once
    by_step = {m.step: m.value for m in history}
    assert by_step[4] == 6.0 and by_step[5] == 105.0  # first trajectory kept, then the new one
    assert sorted(m.step for m in client.get_metric_history(run_id, "val/acc")) == [2, 3, 4, 5, 6]
    assert last_logged_step(second, "train/loss") == 6
    assert len(client.search_runs([client.get_run(run_id).info.experiment_id])) >= 1


def test_plain_mlflow_duplicates_a_step(store):
    """Why the dedup exists: MLflow appends a second point for a step logged again."""
    logger = _logger(store, skip_logged_steps=False)
    client, run_id = logger.experiment, logger.run_id
    client.log_batch(run_id, metrics=[Metric("m", 1.0, 1000, 3)])
    again = _logger(store, run_id=run_id, skip_logged_steps=False)
    again.log_metrics({"m": 2.0}, step=3)
    assert sorted(m.value for m in client.get_metric_history(run_id, "m")) == [1.0, 2.0]
    assert last_logged_step(again, "m") == 3


def test_resume_unknown_run_fails_clearly(store):
    with pytest.raises(ValueError, match="cannot resume"):
        _logger(store, run_id=uuid.uuid4().hex)


def test_trainer_logs_through_the_logger(store):
    """A two-step Lightning fit: hyperparameters, metrics at global steps, run finished."""
    import lightning.pytorch as pl
    import torch

    class Tiny(pl.LightningModule):
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.w = torch.nn.Parameter(torch.ones(1))

        def training_step(self, batch, batch_idx):
            loss = (self.w * batch[0]).pow(2).mean()
            self.log("train/loss", loss, on_step=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 1)))

    logger = _logger(store)
    trainer = pl.Trainer(max_steps=3, logger=logger, log_every_n_steps=1, accelerator="cpu",
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Tiny())
    client = logger.experiment
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED" and run.data.params["lr"] == "0.1"
    assert sorted(m.step for m in client.get_metric_history(logger.run_id, "train/loss")) \
        == [0, 1, 2]


def test_a_held_store_lock_times_out_naming_the_lock(tmp_path: Path) -> None:
    # another process holds the store's lock (a job opening the store, or a stuck one): opening
    # the store must fail with the lock's path after the timeout, never hang
    import subprocess
    import sys
    import time

    from saopd.runs.tracking import StoreLockTimeout, store_lock

    db = tmp_path / "mlflow.db"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from filelock import FileLock; "
         f"lock = FileLock({str(db) + '.lock'!r}); lock.acquire(); print('held', flush=True); "
         "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        held = r"mlflow\.db\.lock is held by another process"
        with pytest.raises(StoreLockTimeout, match=held), \
                store_lock(f"sqlite:///{db}", timeout_s=0.5):
            pass
        assert time.monotonic() - started < 30
    finally:
        holder.kill()
        holder.wait()
    with store_lock(f"sqlite:///{db}", timeout_s=5):  # a killed holder released it
        pass


def test_a_locked_sqlite_store_is_a_clear_error(tmp_path: Path) -> None:
    # issue 15, point 13: another process holding a write transaction on mlflow.db used to end
    # in a raw sqlalchemy traceback ("database is locked")
    import sqlite3
    import subprocess
    import sys

    from saopd.runs.tracking import StoreLockTimeout

    db = tmp_path / "mlflow.db"
    make_mlflow_logger(experiment_name="x", tracking_uri=f"sqlite:///{db}", run_name="a",
                       root=tmp_path)  # the store exists
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import sqlite3, time; c = sqlite3.connect({str(db)!r}); "
         "c.execute('BEGIN EXCLUSIVE'); print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StoreLockTimeout, match=r"the database is locked by another process"):
            make_mlflow_logger(experiment_name="x", tracking_uri=f"sqlite:///{db}",
                               run_name="b", root=tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert sqlite3.connect(db).execute("select count(*) from runs").fetchone()[0] == 1
