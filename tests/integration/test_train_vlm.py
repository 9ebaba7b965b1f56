"""One SA-OPD step end to end on tiny VLMs (saopd.train.train, experiment=tiny_vlm): images in the
full context, the residual variant as configured, gradients reaching the student's vision tower;
configuration errors; the paper's VLM setups carry Appendix B's hyperparameters."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from saopd.config import to_train_config
from saopd.config.model import ModelConfig
from saopd.contexts.vision import VisionContexts
from saopd.models.factory import build_vlm
from saopd.train import UserError, train
from tests.conftest import compose_train
from tests.helpers.vlm import synth_dir


def _capture(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    seen: list[Any] = []
    original = VisionContexts.collate

    def collate(self: VisionContexts, *args: Any, **kwargs: Any) -> Any:
        batch = original(self, *args, **kwargs)
        seen.append(batch)
        return batch

    monkeypatch.setattr(VisionContexts, "collate", collate)
    return seen


@pytest.mark.parametrize("remove", ["all", "text"])
def test_one_training_step_on_tiny_vlms(make_cfg, monkeypatch: pytest.MonkeyPatch,
                                        remove: str) -> None:
    seen = _capture(monkeypatch)
    cfg = make_cfg("experiment=tiny_vlm", "steps=1", f"data.path={synth_dir() / 'train.jsonl'}",
                   f"data.residual_remove={remove}", "trainer.view_every_n_steps=0",
                   mlflow=False)
    out = train(cfg)
    assert out["steps"] == 1 and out["data"]["prompts_read"] == 12
    assert all(math.isfinite(out["metrics"][k]) for k in ("train/loss", "train/kl", "train/flmr"))
    assert out["metrics"]["train/tokens"] > 0
    (batch,) = seen  # 2 prompts x 2 samples, each prompt with one image
    assert batch.full.vision.num_images == 4 and batch.full.vision.pixel_values.shape[0] > 0
    assert batch.residual.vision.num_images == (4 if remove == "text" else 0)
    assert int(batch.residual.mm_token_type_ids.sum()) == \
        (int(batch.full.mm_token_type_ids.sum()) if remove == "text" else 0)
    # the student's vision tower was trained through the full-context pass
    state = torch.load(Path(out["last_checkpoint"]), map_location="cpu",
                       weights_only=False)["state_dict"]
    init, _ = build_vlm(ModelConfig(tiny="qwen3_5", seed=1))
    visual = [k for k in init.state_dict() if ".visual." in f".{k}"]
    assert visual
    moved = [k for k in visual if not torch.equal(state[f"student.{k}"], init.state_dict()[k])]
    assert moved, "no vision-tower weight changed: images did not reach the loss"


def test_configuration_errors_are_user_errors(make_cfg) -> None:
    data = f"data.path={synth_dir() / 'train.jsonl'}"
    with pytest.raises(UserError, match=r"models: student and teacher processors differ.*"
                                        r"patch_size: student 16 vs teacher 14"):
        train(make_cfg("experiment=tiny_vlm", data, "model@teacher=tiny_qwen2_vl", mlflow=False))
    with pytest.raises(UserError, match=r"data.source=vision needs vision-language models"):
        train(make_cfg("experiment=tiny", "data=vision", data, "steps=1", mlflow=False))
    with pytest.raises(UserError, match=r"student and teacher must both be vision-language"):
        train(make_cfg("experiment=tiny_vlm", data, "model@teacher=tiny_qwen3", mlflow=False))
    with pytest.raises(UserError, match=r"run `dvc repro prepare_vlm`"):
        train(make_cfg("experiment=tiny_vlm", "data.path=/nonexistent/vlm.jsonl", mlflow=False))


@pytest.mark.parametrize(
    ("experiment", "steps", "beta_max", "teacher", "eval_tokens"),
    [
        ("vlm_understanding_qwen3_5_35b_a3b_to_2b", 700, 0.018, "Qwen/Qwen3.5-35B-A3B", 1024),
        ("vlm_reasoning_qwen3_5_35b_a3b_to_2b", 270, None, "Qwen/Qwen3.5-35B-A3B", 4096),
        ("vlm_understanding_qwen3_5_9b_to_2b", 700, 0.018, "Qwen/Qwen3.5-9B", 1024),
        ("vlm_reasoning_qwen3_5_9b_to_2b", 270, None, "Qwen/Qwen3.5-9B", 4096),
    ],
)
def test_paper_vlm_setups_have_appendix_b_hyperparameters(
        tmp_path: Path, experiment: str, steps: int, beta_max: float | None, teacher: str,
        eval_tokens: int) -> None:
    conf = to_train_config(compose_train(tmp_path, f"experiment={experiment}"))
    assert (conf.steps, conf.prompts_per_step, conf.optim.lr) == (steps, 128, 1e-6)
    assert (conf.filter["name"], conf.filter["p1"], conf.filter["p2"]) == ("sa_opd", 0.2, 0.3)
    assert conf.filter["beta_max"] == beta_max and conf.filter["beta_min"] is None
    assert (conf.data.max_prompt_length, conf.rollout.max_new_tokens) == (12000, 4096)
    assert conf.teacher.name_or_path == teacher and conf.student.name_or_path == "Qwen/Qwen3.5-2B"
    assert conf.teacher.is_vision and conf.student.is_vision and conf.data.source == "vision"
    assert conf.data.chat_template_kwargs == {"enable_thinking": False}
    assert conf.eval.max_new_tokens == eval_tokens and conf.trainer.accelerator == "gpu"
    # with vLLM rollouts the setup's sampling settings stay (the experiment merges after the group)
    vllm = to_train_config(compose_train(tmp_path, f"experiment={experiment}", "rollout=vllm"))
    assert vllm.rollout.engine == "vllm" and vllm.rollout.max_images_per_prompt == 4
    assert (vllm.rollout.max_new_tokens, vllm.rollout.temperature) == (4096, 1.0)


def test_evaluation_during_training_sees_the_images(make_cfg) -> None:
    """EvalCallback's engine gets the student's processor: image prompts are evaluated."""
    data = synth_dir()
    out = train(make_cfg("experiment=tiny_vlm", "steps=1", f"data.path={data / 'train.jsonl'}",
                         "eval.every_n_steps=1", "eval.benchmarks=[synth_vqa]", "eval.limit=3",
                         "eval.max_new_tokens=4", f"eval.data_dir={data.parent / 'eval'}",
                         "trainer.view_every_n_steps=0", mlflow=False))
    path = Path(out["output_dir"]) / "eval" / "step_000000" / "synth_vqa.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 3 and all("response" in r for r in rows)
