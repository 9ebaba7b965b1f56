"""End to end on tiny random models: training, MLflow, checkpoints, exact resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import mlflow
import pytest
import torch

import saopd.scoring.passes as scoring
from saopd.filters import FILTERS
from saopd.objectives import OBJECTIVES
from saopd.train import train
from tests.conftest import REPO

REQUIRED_METRICS = ("train/loss", "train/flmr", "train/filtered_ratio", "train/alpha",
                    "train/kl", "train/grounding_gap_filtered", "train/grounding_gap_kept",
                    "train/response_length", "train/step_time", "train/entropy_student_kept",
                    # every statistic the filter returns is logged (p1/p2 used to be dropped)
                    "train/p1", "train/p2", "train/n_valid", "train/n_filtered")


def student_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("student.")}


def test_tiny_run_logs_checkpoints_and_views(make_cfg, tmp_path: Path) -> None:
    summary = train(make_cfg("experiment=tiny", "filter.p1=0.5", "filter.p2=0.5"))
    assert summary["steps"] == 3
    out = Path(summary["output_dir"])

    client = mlflow.MlflowClient(summary["tracking_uri"])
    run = client.get_run(summary["run_id"])
    for key in REQUIRED_METRICS:
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        if key == "train/grounding_gap_filtered":  # only steps that filtered something
            assert steps and steps == sorted(set(steps))
        else:
            assert steps == [0, 1, 2], key  # MLflow step = 0-based optimizer step
    assert run.data.params["filter.name"] == "sa_opd"
    assert run.data.params["filter.p1"] == "0.5"
    assert run.data.tags["filter"] == "sa_opd"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config", "token_view"} <= artifacts
    views = client.list_artifacts(run.info.run_id, "token_view")
    assert len(views) == 3
    html = (out / "token_view" / "step_000002.html").read_text()
    assert "tok flt" in html or summary["metrics"]["train/filtered_ratio"] == 0

    kept = sorted(p.name for p in (out / "checkpoints").glob("*.ckpt"))
    assert kept == ["last.ckpt", "step_000003.ckpt"]  # only the latest periodic checkpoint
    state = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu",
                       weights_only=False)["state_dict"]
    assert not any(k.startswith("teacher.") for k in state)  # frozen teacher not saved
    assert any(k.startswith("student.") for k in state)
    assert all(torch.isfinite(torch.tensor(v)) for v in summary["metrics"].values())


def test_vanilla_opd_runs_no_residual_pass(make_cfg, monkeypatch) -> None:
    calls: list[str] = []
    original = scoring.response_source

    def counting(model, ctx, **kw):
        calls.append("residual" if ctx is current["batch"].residual else "full")
        return original(model, ctx, **kw)

    current: dict = {}
    original_frozen = scoring.score_frozen

    def remember(batch, **kw):
        current["batch"] = batch
        return original_frozen(batch, **kw)

    monkeypatch.setattr(scoring, "response_source", counting)
    monkeypatch.setattr(scoring, "score_frozen", remember)
    import saopd.lightning.module as module

    monkeypatch.setattr(module, "score_frozen", remember)
    train(make_cfg("experiment=tiny", "steps=1", "filter=none", mlflow=False))
    assert calls.count("residual") == 0 and calls.count("full") == 2  # teacher + student
    calls.clear()
    train(make_cfg("experiment=tiny", "steps=1", "filter=sa_opd", mlflow=False))
    assert calls.count("residual") == 2 and calls.count("full") == 2


class GradCapture(L.Callback):
    """Keeps the student's gradients as the optimizer is about to step."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads = {n: p.grad.detach().clone() for n, p in pl_module.student.named_parameters()
                      if p.grad is not None}


def test_micro_batches_give_the_full_batch_gradient(make_cfg, tmp_path: Path) -> None:
    # 3 prompts x n=2 = 6 rollouts: one pass, or micro-batches of 4 + 2 normalised by the
    # step's global token count; the filter sees the whole batch in both
    grads = []
    losses = []
    for tmp, extra in ((tmp_path / "a", []), (tmp_path / "b", ["step.micro_batch_size=4"])):
        capture = GradCapture()
        out = train(make_cfg("experiment=tiny", "steps=1", "prompts_per_step=3", *extra,
                             mlflow=False, tmp=tmp), extra_callbacks=[capture])
        grads.append(capture.grads)
        losses.append(out["metrics"]["train/loss"])
    assert grads[0] and grads[0].keys() == grads[1].keys()
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-8)


KILL_SCRIPT = textwrap.dedent("""
    import os, sys
    import lightning as L
    sys.path.insert(0, {tests!r})
    from tests.conftest import compose_train
    from pathlib import Path
    from saopd.train import train

    class Kill(L.Callback):
        # a hard kill after step 3 has been logged but before its checkpoint is written
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 3:
                os._exit(137)

    cfg = compose_train(Path({tmp!r}), *{overrides!r})
    train(cfg, extra_callbacks=[Kill()])
""")


def test_hard_kill_and_resume_equals_a_straight_run(make_cfg, tmp_path: Path) -> None:
    overrides = ["experiment=tiny", "steps=6"]
    straight = train(make_cfg(*overrides, tmp=tmp_path / "straight"))

    killed = tmp_path / "killed"
    script = KILL_SCRIPT.format(tests=str(REPO / "tests"), tmp=str(killed),
                                overrides=overrides)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 137, proc.stderr[-2000:]
    run_dir = killed / "run"
    record = json.loads((run_dir / "saopd_run.json").read_text())
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()

    resumed = train(make_cfg(*overrides, f"resume={run_dir}", tmp=killed))
    assert resumed["run_id"] == record["run_id"] and resumed["steps"] == 6

    a = student_weights(Path(straight["last_checkpoint"]))
    b = student_weights(Path(resumed["last_checkpoint"]))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6)
    client = mlflow.MlflowClient(resumed["tracking_uri"])
    steps = [m.step for m in client.get_metric_history(resumed["run_id"], "train/loss")]
    assert steps == [0, 1, 2, 3, 4, 5]  # no step logged twice
    ref = {m.step: m.value for m in mlflow.MlflowClient(straight["tracking_uri"])
           .get_metric_history(straight["run_id"], "train/loss")}
    got = {m.step: m.value for m in client.get_metric_history(resumed["run_id"], "train/loss")}
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-6)


def test_left_truncated_prompts_are_scored_as_sampled(make_cfg) -> None:
    # prompts longer than 40 tokens are cut from the left by the engine and counted; scoring
    # uses the very ids the engine sampled from (Rollout.prompt_ids)
    seen: list = []
    import saopd.contexts.text as module

    original = module.collate_contexts

    def spy(tokenizer, messages, responses, **kw):
        seen.append(kw["prompt_ids"])
        return original(tokenizer, messages, responses, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(module, "collate_contexts", spy)
    try:
        out = train(make_cfg("experiment=tiny", "steps=1", "data.long_prompts=truncate",
                             "data.max_prompt_length=40", mlflow=False))
    finally:
        mp.undo()
    assert out["metrics"]["train/truncated_prompts"] > 0
    assert seen and all(ids is not None and len(ids) <= 40 for ids in seen[0])


def test_chat_template_kwargs_reach_text_rollouts_and_contexts(make_cfg) -> None:
    # data.chat_template_kwargs (enable_thinking: false, the non-thinking mode of Qwen3's
    # template) shape the sampled prompt and both contexts of a text model, not only a VLM's
    from saopd.prompts.render import render_prompt_ids

    seen: list = []
    import saopd.contexts.text as module

    original = module.collate_contexts

    def spy(tokenizer, messages, responses, **kw):
        seen.append((tokenizer, messages, kw))
        return original(tokenizer, messages, responses, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(module, "collate_contexts", spy)
    try:
        train(make_cfg("experiment=tiny", "steps=1",
                       "+data.chat_template_kwargs.enable_thinking=false", mlflow=False))
    finally:
        mp.undo()
    tok, messages, kw = seen[0]
    assert kw["chat_template_kwargs"] == {"enable_thinking": False}
    off = render_prompt_ids(tok, messages[0], add_generation_prompt=True,
                            chat_template_kwargs={"enable_thinking": False})
    assert off != render_prompt_ids(tok, messages[0], add_generation_prompt=True)
    assert kw["prompt_ids"][0] == off  # the engine sampled from the non-thinking prompt


@pytest.mark.parametrize("where", ["before_fit", "in_fit"])
def test_the_engine_is_closed_when_training_fails(make_cfg, monkeypatch, where: str) -> None:
    # an engine holding its own model copy (vLLM) must be freed even when the run fails:
    # sweeps run their jobs in one process
    import saopd.train as train_module

    built, real = [], train_module.build_run_engine

    class Closing:
        closed = False

        def __init__(self, engine) -> None:
            self.engine = engine

        def generate(self, *args, **kwargs):
            return self.engine.generate(*args, **kwargs)

        def close(self) -> None:
            self.closed = True

    def build(*args, **kwargs):
        built.append(Closing(real(*args, **kwargs)))
        return built[-1]

    class Boom(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            raise RuntimeError("boom")

    def broken_logger(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(train_module, "build_run_engine", build)
    if where == "before_fit":  # the tracking set-up fails after the engine was built
        monkeypatch.setattr(train_module, "start_tracking", broken_logger)
    with pytest.raises(RuntimeError, match="boom"):
        train(make_cfg("experiment=tiny", "steps=1", mlflow=False),
              extra_callbacks=[Boom()] if where == "in_fit" else [])
    assert len(built) == 1 and built[0].closed


@pytest.mark.parametrize(
    "overrides",
    # every registered filter and objective (a new one is covered without editing this list),
    # then combinations worth a run of their own
    [[f"filter={name}"] for name in FILTERS.names()]
    + [[f"objective={name}"] for name in OBJECTIVES.names()]
    + [["objective=exopd", "filter=tip"], ["objective=topk_kl", "objective.direction=reverse"],
       ["method=entropy_aware"], ["method=teachability", "objective=entropy_aware"],
       ["filter.extreme=two_sided", "filter.beta_min=0.01", "filter.beta_max=0.02"]],
    ids=lambda o: "+".join(o),
)
def test_every_filter_and_objective_trains(make_cfg, overrides: list[str]) -> None:
    out = train(make_cfg("experiment=tiny", "steps=1", *overrides, mlflow=False))
    metrics = out["metrics"]
    assert out["steps"] == 1
    assert all(v == v and abs(v) != float("inf") for v in metrics.values())  # no NaN / inf
    assert 0.0 <= metrics["train/filtered_ratio"] <= 1.0


def test_training_reads_the_pipelines_prepared_schema(make_cfg, tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"What is {i} + {i}?"}],
             "prompt": f"What is {i} + {i}?", "answer": str(2 * i), "source": "toy",
             "metadata": {}} for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = train(make_cfg("experiment=tiny", "steps=1", "data=prepared", f"data.path={path}",
                         "data.max_prompt_length=256", mlflow=False))
    assert out["data"]["prompts_read"] == 6 and out["steps"] == 1

    path.write_text('{"id": "x", "prompt": "no messages"}\n')
    from saopd.train import UserError

    with pytest.raises(UserError, match=r"train.jsonl: row 1 lacks 'id' or a 'messages' list"):
        train(make_cfg("experiment=tiny", "steps=1", "data=prepared", f"data.path={path}",
                       mlflow=False))


def test_logged_learning_rate_follows_the_warmup(make_cfg, tmp_path: Path) -> None:
    # warm-up over 2 steps to lr = 1e-3: the rates used by steps 0, 1, 2 are 5e-4, 1e-3, 1e-3
    out = train(make_cfg("experiment=tiny", "steps=3", "optim.warmup_steps=2",
                         tmp=tmp_path / "lr"))
    client = mlflow.MlflowClient(out["tracking_uri"])
    lrs = sorted((m.step, m.value) for m in client.get_metric_history(out["run_id"], "train/lr"))
    assert [round(v, 10) for _, v in lrs] == [5e-4, 1e-3, 1e-3]


def test_a_teacher_with_its_own_template_and_specials_trains(make_cfg, tmp_path: Path,
                                                             monkeypatch) -> None:
    """A Qwen3 student with a teacher whose tokenizer renames the specials and has its own
    template (DeepSeek-R1-0528-Qwen3-8B's shape): the pair is accepted as ``specials_differ``
    and the teacher scores contexts rendered in its template, ending on its EOS."""
    from saopd.models.tiny import tiny_qwen3
    from saopd.models.tokenizers import qwen_tokenizer
    from tests.helpers.tokenizer_pairs import deepseek_style_tokenizer

    for name, tok, seed in (("student", qwen_tokenizer(), 1),
                            ("teacher", deepseek_style_tokenizer(), 2)):
        tiny_qwen3(tok, layers=1, hidden=32, head_dim=16, seed=seed).save_pretrained(
            tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    seen: list = []
    original = scoring.score_frozen

    def spy(batch, **kw):
        seen.append(batch)
        return original(batch, **kw)

    import saopd.lightning.module as module_mod

    monkeypatch.setattr(module_mod, "score_frozen", spy)
    summary = train(make_cfg("experiment=tiny", "steps=1", "student.tiny=null",
                             "teacher.tiny=null", f"student.name_or_path={tmp_path / 'student'}",
                             f"teacher.name_or_path={tmp_path / 'teacher'}", mlflow=False))
    assert seen and seen[0].teacher is not None
    tb = seen[0].teacher
    assert int(tb.full.input_ids[0, 0]) == 151646  # the teacher's BOS opens its template
    assert 151644 in tb.full.input_ids[0].tolist()  # <｜User｜> (the student's <|im_start|>)
    ended = seen[0].response_ids == 151645  # rows that ended on the student's <|im_end|> ...
    assert bool((tb.response_ids[ended] == 151643).all())  # ... end on the teacher's EOS
    assert all(torch.isfinite(torch.tensor(v)) for v in summary.values()
               if isinstance(v, float))
