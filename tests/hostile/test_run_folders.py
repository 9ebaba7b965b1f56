"""Hostile cases of run folders and checkpoints (issue 27, items 3, 4 and 5), tried as a careless
or malicious neighbour would: copied, moved and doctored run folders, checkpoints without their
sidecar or edited after they were written, a learning rate that explodes, a full disk, bad
environment variables, dangling links, unknown keys, NaN scores. Each case failed (silently or
with a traceback) before the fix. Runs are the tiny experiment, a few steps each."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import mlflow
import pandas as pd
import pytest
import torch

import saopd.runs.checkpoints as checkpoints
from saopd.runs.checkpoints import CheckpointError, read_checkpoint
from saopd.runs.resume import RUN_RECORD, read_run_record
from saopd.runs.tracking import FOLDER_TAG, RUN_UID_TAG, store_lock_timeout
from saopd.train import UserError, train
from tests.conftest import REPO

FAST = ("experiment=tiny", "trainer.view_every_n_steps=0")


def _train(make_cfg, *overrides: str, mlflow: bool = True, tmp: Path | None = None,
           callbacks: list[L.Callback] | None = None) -> dict:
    return train(make_cfg(*FAST, *overrides, mlflow=mlflow, tmp=tmp), extra_callbacks=callbacks)


class StartStep(L.Callback):
    """Records the step training starts from (the resumed checkpoint's)."""

    started: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: object) -> None:
        self.started = trainer.global_step


def _history(uri: str, run_id: str, key: str = "train/loss") -> list[int]:
    return [m.step for m in mlflow.MlflowClient(uri).get_metric_history(run_id, key)]


# ---- copied, moved and doctored run folders ------------------------------------------------

def test_a_copied_run_folder_logs_to_a_new_mlflow_run_never_the_originals(make_cfg,
                                                                          tmp_path: Path) -> None:
    first = _train(make_cfg, "steps=2")
    run, uri = Path(first["output_dir"]), first["tracking_uri"]
    client = mlflow.MlflowClient(uri)
    assert client.get_run(first["run_id"]).info.status == "FINISHED"
    copy = tmp_path / "copy"
    shutil.copytree(run, copy, symlinks=True)  # what `cp -r` does

    resumed = _train(make_cfg, "steps=4", f"resume={copy}")
    assert resumed["output_dir"] == str(copy) and resumed["steps"] == 4
    assert resumed["run_id"] != first["run_id"]  # a new MLflow run ...
    new = client.get_run(resumed["run_id"])
    assert new.data.tags["saopd.copied_from"] == first["run_id"]  # ... tagged with the original
    assert new.data.tags["saopd.copied_from_folder"] == str(run)
    assert _history(uri, resumed["run_id"]) == [2, 3]
    original = client.get_run(first["run_id"])  # untouched: no steps, still FINISHED
    assert _history(uri, first["run_id"]) == [0, 1] and original.info.status == "FINISHED"
    mine, theirs = read_run_record(copy), read_run_record(run)
    assert mine.run_uid != theirs.run_uid and mine.lineage == [theirs.run_uid]
    assert read_checkpoint(copy / "checkpoints" / "last.ckpt")["saopd_run"]["run_uid"] == \
        mine.run_uid  # the copy's checkpoints are its own from now on

    again = _train(make_cfg, "steps=3", f"resume={run}")  # the original goes on as itself
    assert again["run_id"] == first["run_id"] and _history(uri, first["run_id"]) == [0, 1, 2]


def test_a_moved_run_folder_resumes_from_its_newest_step_without_a_pile_up(make_cfg,
                                                                          tmp_path: Path) -> None:
    first = _train(make_cfg, "steps=2")
    moved = tmp_path / "moved"
    shutil.move(first["output_dir"], moved)
    for steps, expect_start in ((3, 2), (4, 3)):
        start = StartStep()
        out = _train(make_cfg, f"steps={steps}", f"resume={moved}", callbacks=[start])
        assert start.started == expect_start  # the newest step, not the one before the move
        assert out["run_id"] == first["run_id"]  # the same run, moved
        files = sorted(p.name for p in (moved / "checkpoints").iterdir())
        assert files == ["last.ckpt", f"step_{steps:06d}.ckpt", f"step_{steps:06d}.ckpt.sha256"]
    assert read_run_record(moved).folder == str(moved)
    assert _history(first["tracking_uri"], first["run_id"]) == [0, 1, 2, 3]
    tags = mlflow.MlflowClient(first["tracking_uri"]).get_run(first["run_id"]).data.tags
    assert tags[FOLDER_TAG] == str(moved) and tags[RUN_UID_TAG] == read_run_record(moved).run_uid


def test_a_copy_of_a_moved_folder_does_not_share_its_mlflow_run(make_cfg, tmp_path: Path) -> None:
    """cp -r run copy; mv run moved: neither record's path exists, but the MLflow run names the
    folder that claimed it last, so the second to resume is the copy."""
    first = _train(make_cfg, "steps=1")
    run = Path(first["output_dir"])
    shutil.copytree(run, tmp_path / "copy", symlinks=True)
    shutil.move(run, tmp_path / "moved")
    a = _train(make_cfg, "steps=2", f"resume={tmp_path / 'moved'}")
    b = _train(make_cfg, "steps=2", f"resume={tmp_path / 'copy'}")
    assert a["run_id"] == first["run_id"] and b["run_id"] != first["run_id"]
    assert _history(first["tracking_uri"], first["run_id"]) == [0, 1]


def test_another_runs_checkpoint_behind_last_ckpt_is_refused_unless_named(make_cfg,
                                                                          tmp_path: Path) -> None:
    mine = _train(make_cfg, "steps=1")
    other = _train(make_cfg, "steps=2", "filter=none", f"paths.output_dir={tmp_path / 'b'}")
    last = Path(mine["output_dir"]) / "checkpoints" / "last.ckpt"
    real = Path(other["last_checkpoint"]).resolve()
    last.unlink()
    shutil.copy(real, last)
    shutil.copy(real.with_name(real.name + ".sha256"), last.with_name("last.ckpt.sha256"))
    with pytest.raises(UserError, match=r"last\.ckpt is a checkpoint of another run .*name "
                                        r"the file: resume="):
        _train(make_cfg, "steps=3", f"resume={mine['output_dir']}")
    # named, it is checked against the config that trained it (filter=none), not the folder's
    with pytest.raises(UserError, match=r"differs from the one that trained checkpoint .*"
                                        r"filter\.name: \"none\" -> \"sa_opd\""):
        _train(make_cfg, "steps=3", f"resume={last}")
    job = tmp_path / "job"
    out = _train(make_cfg, "steps=3", "filter=none", f"resume={last}",
                 f"paths.output_dir={job}")
    assert out["output_dir"] == str(job) and out["steps"] == 3  # a new run in its own folder
    assert read_run_record(job).copied_from["checkpoint"] == str(last)
    tags = mlflow.MlflowClient(out["tracking_uri"]).get_run(out["run_id"]).data.tags
    assert tags["saopd.copied_from"] == other["run_id"]
    assert not (Path(mine["output_dir"]) / "checkpoints" / "step_000003.ckpt").exists()


# ---- checkpoints without their sidecar, edited, dangling ---------------------------------------

def test_a_checkpoint_without_its_sidecar_is_verified_by_its_stored_digest(make_cfg,
                                                                          tmp_path: Path) -> None:
    from saopd.config.model import ModelConfig
    from saopd.evaluate import load_checkpoint_student

    first = _train(make_cfg, "steps=1", mlflow=False)
    real = Path(first["last_checkpoint"]).resolve()
    plain = tmp_path / "plain.ckpt"  # `cp` of the file alone
    shutil.copy(real, plain)
    assert read_checkpoint(plain)["global_step"] == 1
    state = torch.load(plain, weights_only=True)
    name = next(k for k in state["state_dict"] if k.startswith("student."))
    state["state_dict"][name].view(-1)[0] = 1.9e27  # the campaign's corrupt weight
    corrupt = tmp_path / "corrupt.ckpt"
    torch.save(state, corrupt)
    with pytest.raises(CheckpointError, match=r"corrupt\.ckpt is corrupt: its contents differ"):
        read_checkpoint(corrupt)
    with pytest.raises(UserError, match=r"resume: checkpoint .*corrupt\.ckpt is corrupt"):
        _train(make_cfg, "steps=2", f"resume={corrupt}", mlflow=False)
    with pytest.raises(CheckpointError, match="is corrupt"):  # nor evaluated
        load_checkpoint_student(corrupt, ModelConfig(tiny="qwen3"))
    # one with neither a sidecar nor a digest (an older saopd's, copied alone) is refused
    del state["saopd_content_sha256"]
    old = tmp_path / "old.ckpt"
    torch.save(state, old)
    with pytest.raises(CheckpointError, match=r"cannot be verified: .*sha256sum"):
        read_checkpoint(old)


def test_a_dangling_last_ckpt_is_named_once(make_cfg) -> None:
    first = _train(make_cfg, "steps=1", mlflow=False)
    last = Path(first["last_checkpoint"])
    last.resolve().unlink()
    with pytest.raises(UserError) as err:
        _train(make_cfg, "steps=2", f"resume={first['output_dir']}", mlflow=False)
    assert str(err.value) == (f"resume: {last} is a dangling link: the checkpoint it points to "
                              "(step_000001.ckpt) is gone")


# ---- a learning rate that explodes, a full disk, bad settings --------------------------------

def test_huge_but_finite_weights_stop_the_run_before_they_are_saved(make_cfg) -> None:
    with pytest.raises(UserError, match=r"forward is broken after step 0: its weights are "
                                        r"finite but huge"):
        _train(make_cfg, "steps=2", "optim.lr=1e12", mlflow=False)


class ExplodeAt(L.Callback):
    """Sets the learning rate to 1e12 before step ``step``: that update explodes."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: object, *args: object) -> None:
        if trainer.global_step == self.step:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = 1e12


def test_the_resume_point_stays_the_last_healthy_step(make_cfg) -> None:
    with pytest.raises(UserError, match=r"after step 2: .*last checkpoint is its last healthy"):
        _train(make_cfg, "steps=4", callbacks=[ExplodeAt(2)], mlflow=False)
    last = make_cfg(mlflow=False).paths.output_dir + "/checkpoints/last.ckpt"
    state = read_checkpoint(last)
    assert state["global_step"] == 2  # steps 0 and 1, healthy
    assert max(float(v.abs().max()) for v in state["state_dict"].values()) < 1e3


def test_a_full_disk_is_one_line_naming_the_checkpoint(make_cfg, monkeypatch) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    real_open = open
    monkeypatch.setattr(checkpoints, "open",  # every checkpoint write goes to a full device
                        lambda path, mode="r", *a, **k: real_open("/dev/full", mode, *a, **k),
                        raising=False)
    with pytest.raises(UserError) as err:
        _train(make_cfg, "steps=2", mlflow=False)
    message = str(err.value)
    assert "\n" not in message and "unexpected pos" not in message
    assert message.startswith("training stopped after 1 steps: [Errno 28] cannot write the "
                              "checkpoint ") and message.endswith(
        "step_000001.ckpt: No space left on device")


FULL_DISK_CLI = textwrap.dedent("""
    import builtins, sys
    import saopd.runs.checkpoints as checkpoints
    real_open = builtins.open
    checkpoints.open = lambda path, mode="r", *a, **k: real_open("/dev/full", mode, *a, **k)
    from saopd.cli import train_main as main
    sys.argv = ["saopd-train", *sys.argv[1:]]
    main()
""")


def test_an_error_inside_the_training_loop_exits_2_with_one_line(tmp_path: Path) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", FULL_DISK_CLI, *FAST, "steps=2", "logger=none",
         f"hydra.run.dir={tmp_path / 'run'}", f"paths.root={REPO}"],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("saopd-train: error: training stopped after 1 steps: [Errno 28] "
                           "cannot write the checkpoint ") and "No space left" in last


def test_a_bad_store_lock_timeout_names_the_variable(make_cfg, monkeypatch) -> None:
    monkeypatch.setenv("SAOPD_STORE_LOCK_TIMEOUT", "abc")
    with pytest.raises(ValueError, match=r"^SAOPD_STORE_LOCK_TIMEOUT='abc' is not a number"):
        store_lock_timeout()
    with pytest.raises(UserError, match=r"^logger: SAOPD_STORE_LOCK_TIMEOUT='abc'"):
        _train(make_cfg, "steps=1")
    monkeypatch.setenv("SAOPD_STORE_LOCK_TIMEOUT", "-1")
    with pytest.raises(ValueError, match="SAOPD_STORE_LOCK_TIMEOUT='-1'"):
        store_lock_timeout()
    monkeypatch.setenv("SAOPD_STORE_LOCK_TIMEOUT", "2.5")
    assert store_lock_timeout() == 2.5


def test_saopd_eval_refuses_an_unknown_plus_key(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir

    from saopd.evaluate import CONF_DIR, run_eval

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("eval", overrides=["model=tiny_qwen3", f"output_dir={tmp_path}",
                                         "log_to_mlflow=false", "limit=1", "k=1",
                                         "+max_new_tokens.gsm8k=2", "+limt=2",
                                         "+rollout.temprature=0.5"])
    with pytest.raises(ValueError, match=r"unknown config key\(s\): rollout\.temprature \(did "
                                         r"you mean rollout\.temperature\?\); limt \(did you "
                                         r"mean limit\?\)"):
        run_eval(cfg)


def test_saopd_eval_logs_into_a_run_only_its_own_checkpoint(make_cfg, tmp_path: Path) -> None:
    from saopd.config.model import ModelConfig
    from saopd.evaluate import load_checkpoint_student

    a = _train(make_cfg, "steps=1")
    b = _train(make_cfg, "steps=1", f"paths.output_dir={tmp_path / 'b'}")
    ckpt = Path(a["last_checkpoint"])
    assert load_checkpoint_student(ckpt, ModelConfig(tiny="qwen3"))[2] == 1
    with pytest.raises(ValueError, match=f"trained by MLflow run {a['run_id']}, not "
                                         f"{b['run_id']}"):
        load_checkpoint_student(ckpt, ModelConfig(tiny="qwen3"), run_id=b["run_id"])


# ---- reports and studies ---------------------------------------------------------------------

def test_a_nan_score_is_missing_and_its_seed_is_not_counted() -> None:
    from saopd.analysis.tables import paired_recovery, results_table

    scores = pd.DataFrame({"eval/gsm8k/avg_at_1": [0.5, 0.7, float("nan"), 0.4]},
                          index=["r0", "r1", "r2", "b0"])
    labels = pd.Series(["SA-OPD", "SA-OPD", "SA-OPD", "OPD"], index=scores.index)
    table = results_table(scores, {"eval/gsm8k/avg_at_1": "GSM8K"}, labels=labels,
                          spread="ci95")
    assert int(table.n["SA-OPD"]) == 2  # r2 logged NaN: no seed of the row
    assert table.mean.at["SA-OPD", "GSM8K"] == pytest.approx(60.0)
    # the CI of two values: t(0.975, 1) * std / sqrt(2) = 12.706 * 14.142 / 1.414
    assert table.spread.at["SA-OPD", "GSM8K"] == pytest.approx(127.06, rel=1e-3)
    assert any("1 of 4 runs lack GSM8K (not logged, or NaN): SA-OPD (r2)" in n
               for n in table.notes)
    out = paired_recovery({"OPD": {"0": 0.4, "1": 0.4, "2": 0.5},
                           "SA-OPD": {"0": 0.5, "1": float("nan"), "2": 0.6},
                           "control": {"0": 0.6, "1": 0.6, "2": 0.7}},
                          base="OPD", control="control")
    assert out["SA-OPD"]["pairs"] == 2 and out["SA-OPD"]["diff"][0] == pytest.approx(0.1)
    assert not math.isnan(out["SA-OPD"]["diff"][1])


def test_the_testbed_script_refuses_an_unknown_study_before_any_work() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "experiments" / "testbed" / "run.py"),
                           "--studies", "baselines,bogus"], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 2
    assert "unknown studies ['bogus']" in proc.stderr
    assert "+ " not in proc.stdout  # no dvc repro or saopd-train was started


def test_the_run_record_is_written_without_mlflow_too(make_cfg) -> None:
    out = _train(make_cfg, "steps=1", mlflow=False)
    record = read_run_record(Path(out["output_dir"]))
    assert record is not None and record.run_id is None
    assert (Path(out["output_dir"]) / RUN_RECORD).is_file()
    assert read_checkpoint(out["last_checkpoint"])["saopd_run"]["run_uid"] == record.run_uid
