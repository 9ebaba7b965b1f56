"""The ``debug`` config group (``conf/debug``): every overlay composes with every experiment and
sets what it says, and ``debug=fdr`` trains a tiny run end to end in one quick step."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from saopd.config import to_train_config
from saopd.train import CONF_DIR, train
from tests.conftest import REPO

CONF = Path(CONF_DIR)
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
DEBUGS = sorted(p.stem for p in (CONF / "debug").glob("*.yaml"))


@pytest.fixture(scope="module")
def composed(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], DictConfig]:
    """Every (experiment, debug overlay) and every experiment alone (``None``), composed under
    one Hydra initialisation (each initialisation costs seconds)."""
    out = tmp_path_factory.mktemp("debug")
    base = [f"paths.root={REPO}", f"paths.output_dir={out}"]
    configs: dict[tuple[str, str], DictConfig] = {}
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        for experiment in EXPERIMENTS:
            for debug in [None, *DEBUGS]:
                extra = [] if debug is None else [f"debug={debug}"]
                configs[experiment, str(debug)] = compose(
                    "train", overrides=[*base, f"experiment={experiment}", *extra],
                    return_hydra_config=False)
    return configs


def test_the_group_has_the_documented_overlays() -> None:
    assert DEBUGS == ["default", "fdr", "limit", "overfit"]
    assert len(EXPERIMENTS) >= 5


@pytest.mark.parametrize("debug", DEBUGS)
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_each_overlay_composes_with_each_experiment(composed, experiment: str, debug: str
                                                    ) -> None:
    cfg, plain = composed[experiment, debug], composed[experiment, "None"]
    typed = to_train_config(cfg)  # every key the overlay sets is one of the schema's
    assert typed.experiment_name == "debug" != plain.experiment_name
    assert typed.trainer.accelerator == "cpu" and typed.trainer.devices == 1
    assert typed.trainer.strategy == "auto" and typed.trainer.num_nodes == 1
    # what the overlay leaves alone is the experiment's
    assert OmegaConf.to_container(cfg.student) == OmegaConf.to_container(plain.student)
    assert cfg.filter == plain.filter and cfg.optim == plain.optim
    if debug == "fdr":
        assert (typed.steps, typed.prompts_per_step) == (1, 1)
        assert typed.eval.every_n_steps == 0 and not typed.eval.at_start
        assert typed.logger.kind == "none" and plain.logger.kind == "mlflow"
    elif debug == "limit":
        assert (typed.steps, typed.prompts_per_step, typed.data.limit) == (3, 2, 16)
        assert typed.eval.limit == 4 and typed.eval.every_n_steps == plain.eval.every_n_steps
    elif debug == "overfit":
        assert (typed.steps, typed.prompts_per_step, typed.data.limit) == (20, 2, 2)
        assert typed.data.shuffle is False and typed.eval.every_n_steps == 0
    else:
        assert typed.steps == plain.steps and typed.logger.kind == plain.logger.kind


def test_fdr_trains_a_tiny_run_in_one_step(make_cfg, tmp_path: Path) -> None:
    summary = train(make_cfg("experiment=tiny", "debug=fdr"))
    assert summary["steps"] == 1
    assert summary.get("run_id") is None  # no MLflow run
    assert "train/loss" in summary["metrics"]
    assert Path(summary["output_dir"]) == tmp_path / "run"
