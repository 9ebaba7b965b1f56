"""The Hydra config tree: every experiment composes and validates; registries match the YAML."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError

from saopd.config import to_train_config
from saopd.config.teacher_scoring import TEACHER_SCORING_BACKENDS
from saopd.filters import FILTERS
from saopd.objectives import OBJECTIVES
from saopd.scoring.registry import SCORERS
from saopd.train import UserError, train
from tests.conftest import REPO, compose_train

CONF = REPO / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def test_registries_and_config_groups_are_in_step() -> None:
    """Every registered filter/objective has the file named after it; a further filter file is
    a registered filter with other hyperparameters (``sa_opd_flmr``: SA-OPD under the bound)."""
    names = {p.stem: yaml.safe_load(p.read_text())["name"]
             for p in (CONF / "filter").glob("*.yaml")}
    assert all(names.get(name) == name for name in FILTERS.names()), names
    assert set(names.values()) == set(FILTERS.names())
    assert names["sa_opd_flmr"] == "sa_opd"
    assert sorted(p.stem for p in (CONF / "objective").glob("*.yaml")) == OBJECTIVES.names()
    # each teacher-scoring choice (a file named after its backend) has its factory
    assert sorted(p.stem for p in (CONF / "teacher_scoring").glob("*.yaml")) == SCORERS.names()
    assert sorted(TEACHER_SCORING_BACKENDS) == SCORERS.names()


def test_a_variant_is_built_from_its_config_mapping() -> None:
    conf = {"name": "sa_opd", "p1": 0.1, "p2": 0.4}
    built = FILTERS.from_config(conf)
    assert built.name == "sa_opd" and (built.p1, built.p2) == (0.1, 0.4)
    assert conf == {"name": "sa_opd", "p1": 0.1, "p2": 0.4}  # the mapping is not consumed
    assert OBJECTIVES.from_config({"name": "exopd"}).name == "exopd"
    with pytest.raises(ValueError, match=r"unknown filter 'sa_opdd'; allowed: .*sa_opd"):
        FILTERS.from_config({"name": "sa_opdd"})
    with pytest.raises(ValueError, match=r"filter 'sa_opd' got unknown parameter\(s\) \['q1'\]"):
        FILTERS.from_config({"name": "sa_opd", "q1": 0.2})
    with pytest.raises(ValueError, match=r"a filter config needs a 'name'"):
        FILTERS.from_config({"p1": 0.2})


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_validates(experiment: str, tmp_path: Path) -> None:
    conf = to_train_config(compose_train(tmp_path, f"experiment={experiment}"))
    assert conf.experiment_name == experiment
    FILTERS.from_config(conf.filter)  # hyperparameters are valid for the registry
    OBJECTIVES.from_config(conf.objective)


def test_paper_math_setup_has_the_papers_hyperparameters(tmp_path: Path) -> None:
    conf = to_train_config(compose_train(tmp_path, "experiment=math_qwen3_4b_to_1p7b"))
    assert (conf.prompts_per_step, conf.steps, conf.optim.lr) == (128, 160, 1e-6)
    assert (conf.filter["p1"], conf.filter["p2"], conf.filter["beta_max"]) == (0.2, 0.3, None)
    assert (conf.data.max_prompt_length, conf.rollout.max_new_tokens) == (2048, 8192)
    assert conf.teacher.name_or_path == "Qwen/Qwen3-4B-Instruct-2507"
    assert conf.student.name_or_path == "Qwen/Qwen3-1.7B"


def test_default_is_the_testbed_cpu_experiment(tmp_path: Path) -> None:
    """The default run is the arithmetic testbed with SA-OPD on CPU, evaluated before and after
    training, distilling from the teacher with the harmful prior; its models are files in the
    repository (no training, no hub)."""
    conf = to_train_config(compose_train(tmp_path))
    assert conf.experiment_name == "testbed"
    assert conf.filter["name"] == "sa_opd" and conf.objective["name"] == "sampled"
    assert conf.trainer.accelerator == "cpu"
    assert conf.eval.at_start and conf.eval.benchmarks == ["arith"]
    assert conf.eval.every_n_steps and conf.steps % conf.eval.every_n_steps == 0
    assert conf.trainer.threads == 1
    assert Path(conf.teacher.name_or_path).name == "teacher_prior"
    for model in (conf.student, conf.teacher):
        assert (Path(model.name_or_path) / "model.safetensors").is_file(), model.name_or_path
    smollm2 = to_train_config(compose_train(tmp_path, "experiment=smollm2_gsm8k"))
    assert smollm2.student.prune_every == 3 and smollm2.filter["name"] == "sa_opd"


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("optim.lr=-1", r"optim.lr must be > 0, got -1"),
        ("rollout.top_p=1.5", r"rollout.top_p must be in \[0, 1\], got 1.5"),
        ("step.aggregation=mean", r"step.aggregation must be one of"),
        ("steps=0", r"steps must be an int >= 1, got 0"),
        ("data.long_prompts=drop", r"data.long_prompts must be one of \['skip', 'error'"),
        ("trainer.threads=0", r"trainer.threads must be null or an int >= 1, got 0"),
    ],
)
def test_bad_values_name_the_key(override: str, match: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=match):
        to_train_config(compose_train(tmp_path, "experiment=tiny", override))


@pytest.mark.parametrize("override", ["rollout.temperature=0.7", "rollout.top_p=0.95",
                                      "rollout.temperature=1.3"])
def test_tempered_or_truncated_training_rollouts_are_refused(override: str,
                                                             tmp_path: Path) -> None:
    """Scoring is at temperature 1 over the full vocabulary: a tempered / nucleus sampler would
    make the rollouts off-policy silently, so it is refused by name (greedy decoding is not
    a sampler, and evaluation sampling is separate)."""
    with pytest.raises(ValueError, match=rf"{override.split('=')[0]}=.*off-policy"):
        to_train_config(compose_train(tmp_path, "experiment=tiny", override))
    conf = to_train_config(compose_train(tmp_path, "experiment=tiny", override,
                                         "rollout.greedy=true"))
    assert conf.rollout.greedy
    conf = to_train_config(compose_train(tmp_path, "experiment=tiny", "eval.top_p=0.5"))
    assert conf.eval.top_p == 0.5 and conf.rollout.top_p == 1.0


def test_type_errors_and_unknown_keys_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigCompositionException, match="override steps=abc"):
        compose_train(tmp_path, "experiment=tiny", "steps=abc")
    with pytest.raises((ConfigCompositionException, ConfigKeyError), match="no_such_key"):
        compose_train(tmp_path, "experiment=tiny", "optim.no_such_key=1")
    with pytest.raises(ConfigCompositionException, match="sa-opd"):
        compose_train(tmp_path, "experiment=tiny", "filter=sa-opd")


def test_bad_filter_value_is_a_user_error(tmp_path: Path) -> None:
    cfg = compose_train(tmp_path, "experiment=tiny", "filter.p1=2.0", mlflow=False)
    expected = r"config group 'filter': .*p1 must be in \[0, 1\], got 2.0"
    with pytest.raises(UserError, match=expected):
        train(cfg)


def test_missing_model_path_is_a_user_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = compose_train(tmp_path, "experiment=tiny", "student.tiny=null",
                        f"student.name_or_path={tmp_path / 'no_such_model'}", mlflow=False)
    with pytest.raises(UserError, match="no_such_model"):
        train(cfg)


@pytest.mark.parametrize(("fields", "as_is"), [
    ({"name_or_path": "Qwen/Qwen3-1.7B"}, True),
    ({"name_or_path": "/models/teacher"}, True),
    ({"name_or_path": "/models/teacher-Q4_K_M.GGUF"}, False),
    ({"name_or_path": "Qwen/Qwen3-1.7B", "prune_every": 2}, False),
    ({"name_or_path": "Qwen/Qwen3-1.7B", "prune_keep": [0, 3]}, False),
    ({"tiny": "qwen3"}, False),
])
def test_a_model_loads_as_is_only_from_unchanged_files(fields: dict, as_is: bool) -> None:
    from saopd.config.model import ModelConfig

    assert ModelConfig(**fields).loads_as_is is as_is
