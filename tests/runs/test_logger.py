"""A run's MLflow logger, tied to its folder: the store it logs to and the experiment's key charts
(the logger against a real store: tests/hostile/test_run_folders.py and tests/integration)."""

from __future__ import annotations

from pathlib import Path

from saopd.config import to_train_config
from saopd.paths import default_tracking_uri
from saopd.runs.logger import key_metrics, run_tracking_uri
from saopd.runs.resume import RunIdentity, RunPlan
from saopd.runs.ui import KEY_METRICS


def test_the_key_charts_lead_with_the_first_held_out_accuracy(make_cfg) -> None:
    evaluated = to_train_config(make_cfg("experiment=testbed", "eval.benchmarks=[arith,gsm8k]",
                                         mlflow=False))
    assert key_metrics(evaluated) == ["eval/arith/avg_at_4", *KEY_METRICS]
    # a run that never evaluates charts its training metrics only
    silent = to_train_config(make_cfg("experiment=testbed", "eval.every_n_steps=0",
                                      "eval.at_start=false", mlflow=False))
    assert key_metrics(silent) == list(KEY_METRICS)


def test_the_store_is_the_configs_else_the_folders_else_the_repositorys(make_cfg,
                                                                        tmp_path: Path) -> None:
    conf = to_train_config(make_cfg("experiment=tiny", mlflow=False))
    plan = RunPlan(checkpoint=None, folder=tmp_path / "run", how="new",
                   identity=RunIdentity.new(tmp_path / "run", {}))
    assert run_tracking_uri(conf, plan) == default_tracking_uri(conf.paths.root)
    plan.identity.tracking_uri = "http://recorded:5000"  # a resumed run: its folder's record
    assert run_tracking_uri(conf, plan) == "http://recorded:5000"
    told = to_train_config(make_cfg("experiment=tiny", "logger.tracking_uri=http://told:5000",
                                    mlflow=False))
    assert run_tracking_uri(told, plan) == "http://told:5000"
