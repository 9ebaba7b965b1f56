"""Hostile cases of studies that outgrow one machine, tried as a new user would: an evaluation
given both a run and a checkpoint, a tracking server on a taken port, a tracking server that is
absent or dies mid-run, searches that cannot finish, a prompt of tens of megabytes, a local Ray
cluster. Each case ended silently, in a raw traceback or in a hang before its fix."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from saopd.evaluate import run_eval
from saopd.train import CONF_DIR, train

FAST = ("experiment=tiny", "trainer.view_every_n_steps=0")
REPO = Path(CONF_DIR).parent


def _compose_eval(tmp: Path, *overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("eval", overrides=[
            f"data_dir={REPO / 'data' / 'prepared' / 'eval'}", f"output_dir={tmp / 'eval'}",
            f"tracking_uri=sqlite:///{tmp / 'mlflow.db'}", "model=tiny_qwen3",
            "benchmarks=[gsm8k]", "limit=1", "k=1", "+max_new_tokens.gsm8k=4",
            "grade_workers=1", *overrides])


# ---- saopd-eval: run_id and checkpoint together ------------------------------------------------

def test_eval_of_a_run_id_and_a_checkpoint_scores_that_checkpoint_or_refuses(
        make_cfg, tmp_path: Path) -> None:
    """run_id=A checkpoint=FILE: FILE is scored (its step logged into A) when it records A, and
    refused when it records another run; A's last.ckpt is never scored in its place."""
    first = train(make_cfg(*FAST, "steps=1"))
    folder = Path(first["output_dir"])
    kept = tmp_path / "kept"  # step 1 of run A, kept aside before A trains on
    shutil.copytree(folder / "checkpoints", kept / "checkpoints")
    (kept / ".hydra").mkdir()
    OmegaConf.save(make_cfg(*FAST), kept / ".hydra" / "config.yaml")
    again = train(make_cfg(*FAST, "steps=2", f"resume={folder}"))
    assert again["run_id"] == first["run_id"] and again["steps"] == 2
    other = train(make_cfg(*FAST, "steps=1", f"paths.output_dir={tmp_path / 'b'}"))

    step_1 = kept / "checkpoints" / "step_000001.ckpt"
    out = run_eval(_compose_eval(tmp_path, f"run_id={first['run_id']}", f"checkpoint={step_1}"))
    assert out["checkpoint"] == str(step_1) and out["step"] == 1  # not A's last.ckpt (step 2)

    theirs = Path(other["last_checkpoint"])
    with pytest.raises(ValueError, match=rf"trained by MLflow run {other['run_id']}, not "
                                         rf"{first['run_id']}"):
        run_eval(_compose_eval(tmp_path, f"run_id={first['run_id']}", f"checkpoint={theirs}"))
