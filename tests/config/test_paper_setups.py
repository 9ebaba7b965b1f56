"""The paper setups (``conf/experiment``) are literally the paper's and every method runs on them.

- Non-thinking mode: Qwen3-1.7B and Qwen3.5 are hybrid models; the paper runs their non-thinking
  variants, so rollouts, both contexts, evaluation during training and ``saopd-eval`` of the
  run's checkpoint all render the empty think block (Qwen3's real template, built offline).
- Every method (``conf/method``) composes and builds its filter and objective on every experiment,
  and every job of every study (``conf/study``) on every paper experiment and the CPU default
  (the tiny ones choose the same filter): no experiment file holds a hyperparameter of one filter
  or objective.
- Algorithm 2's extreme set: two-sided where the FLMR bound is on, Eq. 16's ``|A_full|`` otherwise.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from saopd.config import TrainConfig, to_train_config
from saopd.config.eval import EvalConfig
from saopd.config.rollout import HFRolloutConfig
from saopd.contexts import context_builder
from saopd.evaluate import CONF_DIR as EVAL_CONF_DIR
from saopd.evaluate import eval_chat_template_kwargs
from saopd.filters import FILTERS
from saopd.objectives import OBJECTIVES
from saopd.rollout.registry import build_engine
from saopd.train import CONF_DIR
from tests.conftest import compose_train

CONF = Path(CONF_DIR)
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
PAPER_EXPERIMENTS = [e for e in EXPERIMENTS
                     if not e.startswith(("tiny", "testbed")) and e != "smollm2_gsm8k"]
METHODS = sorted(p.stem for p in (CONF / "method").glob("*.yaml"))
STUDIES = sorted(p.stem for p in (CONF / "study").glob("*.yaml"))
#: The paper's FLMR bound (Appendix B: beta = 1.8 points, visual understanding only).
BOUNDED = {"vlm_understanding_qwen3_5_35b_a3b_to_2b": 0.018,
           "vlm_understanding_qwen3_5_9b_to_2b": 0.018}
THINK_BLOCK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
PROBE_CHAT = [{"role": "user", "content": "What is 17 + 25? Put the answer in \\boxed{}."}]


def study_jobs(study: str) -> list[list[str]]:
    """The overrides of every job of ``study``'s sweep, but one seed (the seed changes no
    filter or objective): the product of its ``hydra.sweeper.params``."""
    params = yaml.safe_load((CONF / "study" / f"{study}.yaml").read_text())["hydra"]["sweeper"][
        "params"]
    parser = OverridesParser.create()
    axes = []
    for key, values in params.items():
        override = parser.parse_override(f"{key}={values}")
        choices = ([str(v) if v is not None else "null"
                    for v in override.sweep_string_iterator()]
                   if override.is_sweep_override() else [override.get_value_string()])
        axes.append([f"{key}={v}" for v in (choices[:1] if key == "seed" else choices)])
    return [list(job) for job in itertools.product(*axes)]


def build_variants(conf: TrainConfig) -> tuple[Any, Any]:
    """The filter and objective ``saopd-train`` builds from ``conf`` (as ``train`` does)."""
    return FILTERS.from_config(conf.filter), OBJECTIVES.from_config(conf.objective)


def assert_extreme_follows_bound(cfg: DictConfig, where: str) -> None:
    """Algorithm 2's two-sided extreme set where the FLMR bound is on, Eq. 16's ``abs`` else."""
    if "extreme" not in cfg.filter:
        return
    bounded = cfg.filter.beta_min is not None or cfg.filter.beta_max is not None
    assert cfg.filter.extreme == ("two_sided" if bounded else "abs"), (
        f"{where}: beta_min={cfg.filter.beta_min}, beta_max={cfg.filter.beta_max} but "
        f"extreme={cfg.filter.extreme}")


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_no_experiment_file_sets_a_filter_or_objective_hyperparameter(experiment: str) -> None:
    node = yaml.safe_load((CONF / "experiment" / f"{experiment}.yaml").read_text())
    assert not {"filter", "objective"} & set(node), (
        f"{experiment}.yaml sets filter/objective values; choose a file of the group instead")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_method_builds_on_every_experiment(tmp_path: Path, experiment: str,
                                                 method: str) -> None:
    cfg = compose_train(tmp_path, f"experiment={experiment}", f"method={method}", mlflow=False)
    conf = to_train_config(cfg)
    build_variants(conf)
    assert conf.method is not None
    assert_extreme_follows_bound(cfg, f"{experiment} method={method}")


@pytest.mark.parametrize("study", STUDIES)
@pytest.mark.parametrize("experiment", [*PAPER_EXPERIMENTS, "smollm2_gsm8k"])
def test_every_study_job_builds_on_every_experiment(tmp_path: Path, experiment: str,
                                                    study: str) -> None:
    jobs = study_jobs(study)
    assert jobs
    for job in jobs:
        cfg = compose_train(tmp_path, f"experiment={experiment}", f"study={study}", *job,
                            mlflow=False)
        build_variants(to_train_config(cfg))
        assert_extreme_follows_bound(cfg, f"{experiment} study={study} {job}")


def test_the_study_expansion_sees_every_job() -> None:
    assert [j[0] for j in study_jobs("baselines")] == [
        f"method={m}" for m in ("opd", "exopd", "tip", "fire_opd", "teachability",
                                "entropy_aware", "sa_opd")]
    assert len(study_jobs("p1p2_grid")) == 9


@pytest.mark.parametrize("experiment", PAPER_EXPERIMENTS)
def test_paper_setups_follow_the_flmr_bound_and_its_extreme_set(tmp_path: Path,
                                                                experiment: str) -> None:
    for method in ([], ["method=sa_opd"]):
        cfg = compose_train(tmp_path, f"experiment={experiment}", *method, mlflow=False)
        assert cfg.filter.name == "sa_opd"
        assert (cfg.filter.p1, cfg.filter.p2) == (0.2, 0.3)
        assert cfg.filter.beta_min is None
        assert cfg.filter.beta_max == BOUNDED.get(experiment)
        assert cfg.filter.extreme == ("two_sided" if experiment in BOUNDED else "abs")


class _FakeLM(torch.nn.Module):
    """Stands in for the student where only prompt rendering is exercised (nothing generates)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the rendering test must not generate")


@pytest.mark.parametrize("experiment", PAPER_EXPERIMENTS)
def test_paper_setups_render_the_non_thinking_prompt_everywhere(tmp_path: Path, qwen_tok: Any,
                                                                experiment: str) -> None:
    cfg = compose_train(tmp_path, f"experiment={experiment}", mlflow=False)
    conf = to_train_config(cfg)
    kwargs = conf.data.chat_template_kwargs
    assert kwargs == {"enable_thinking": False}
    assert "qwen" in f"{conf.student.name_or_path}".lower()

    def text(ids: Any) -> str:
        return qwen_tok.decode([int(i) for i in ids])

    # rollouts: the engine saopd-train builds (train.py passes data.chat_template_kwargs)
    engine = build_engine(HFRolloutConfig(), _FakeLM(), qwen_tok,
                          max_prompt_length=conf.data.max_prompt_length,
                          chat_template_kwargs=kwargs)
    rollout_prompt = engine.prompt_ids(PROBE_CHAT)
    assert text(rollout_prompt).endswith(THINK_BLOCK)

    # full and residual contexts of a fake rollout, as the step builds them; the teacher and the
    # student score these same ids (one shared tokenizer)
    builder = context_builder(qwen_tok, None, residual_remove=conf.data.residual_remove,
                              chat_template_kwargs=kwargs)
    response = qwen_tok("The answer is \\boxed{42}.<|im_end|>", add_special_tokens=False)[
        "input_ids"]
    for prompt_ids in (None, [rollout_prompt]):
        batch = builder.collate([PROBE_CHAT], [response], step=conf.step, prompt_ids=prompt_ids)
        for ctx in (batch.full, batch.residual):
            start = int(ctx.starts[0])
            assert text(ctx.input_ids[0, :start]).endswith(THINK_BLOCK)
            assert ctx.input_ids[0, start:start + len(response)].tolist() == response
        assert batch.full.input_ids[0, :int(batch.full.starts[0])].tolist() == rollout_prompt

    # evaluation during training: EvalCallback samples with the contexts' template variables
    eval_engine = build_engine(HFRolloutConfig(), _FakeLM(), qwen_tok,
                               chat_template_kwargs=builder.chat_template_kwargs)
    assert text(eval_engine.prompt_ids(PROBE_CHAT)).endswith(THINK_BLOCK)

    # saopd-eval of the run's checkpoint: the run's data.chat_template_kwargs, no option needed
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    with initialize_config_dir(config_dir=EVAL_CONF_DIR, version_base="1.3"):
        eval_cfg = compose("eval", overrides=[f"checkpoint={ckpt}",
                                              f"output_dir={tmp_path / 'eval'}"])
    eval_conf = OmegaConf.to_object(eval_cfg)
    assert isinstance(eval_conf, EvalConfig)
    used = eval_chat_template_kwargs(eval_conf.chat_template_kwargs, ckpt,
                                     from_run=eval_conf.chat_template_from_run)
    assert used == {"enable_thinking": False}
    saopd_eval = build_engine(eval_conf.rollout, _FakeLM(), qwen_tok, chat_template_kwargs=used)
    assert text(saopd_eval.prompt_ids(PROBE_CHAT)).endswith(THINK_BLOCK)


def test_saopd_eval_template_variables_from_the_run_and_the_command_line(
        tmp_path: Path, qwen_tok: Any) -> None:
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(compose_train(tmp_path, "experiment=math_qwen3_4b_to_1p7b", mlflow=False),
                   run_dir / ".hydra" / "config.yaml")
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    assert eval_chat_template_kwargs({}, ckpt) == {"enable_thinking": False}
    assert eval_chat_template_kwargs({"enable_thinking": True}, ckpt) == {"enable_thinking": True}
    assert eval_chat_template_kwargs({}, ckpt, from_run=False) == {}
    assert eval_chat_template_kwargs({}, None) == {}
    assert eval_chat_template_kwargs({}, tmp_path / "elsewhere" / "checkpoints" / "x.ckpt") == {}
    # a paper student from the hub (no run): the documented override
    with initialize_config_dir(config_dir=EVAL_CONF_DIR, version_base="1.3"):
        eval_cfg = compose("eval", overrides=["model=qwen3_1p7b",
                                              "+chat_template_kwargs.enable_thinking=false",
                                              f"output_dir={tmp_path / 'eval'}"])
    given = OmegaConf.to_object(eval_cfg).chat_template_kwargs  # type: ignore[union-attr]
    engine = build_engine(HFRolloutConfig(), _FakeLM(), qwen_tok,
                          chat_template_kwargs=eval_chat_template_kwargs(given, None))
    assert qwen_tok.decode(engine.prompt_ids(PROBE_CHAT)).endswith(THINK_BLOCK)
    plain = build_engine(HFRolloutConfig(), _FakeLM(), qwen_tok)
    assert not qwen_tok.decode(plain.prompt_ids(PROBE_CHAT)).endswith(THINK_BLOCK)


@pytest.mark.parametrize("experiment", PAPER_EXPERIMENTS)
def test_paper_students_keep_fp32_master_weights(experiment: str, tmp_path: Path) -> None:
    # a bf16-loaded student would keep bf16 weights and AdamW state (no fp32 master copy) under
    # trainer=gpu's autocast and under FSDP's bf16 policy alike
    conf = to_train_config(compose_train(tmp_path, f"experiment={experiment}", mlflow=False))
    assert conf.student.dtype == "float32"
    assert conf.teacher.dtype == "bfloat16"
