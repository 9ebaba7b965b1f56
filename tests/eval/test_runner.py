"""saopd-eval and the training-time evaluation: Avg@k arithmetic, files, MLflow, checkpoints."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlflow
import pytest
import torch
from hydra import compose, initialize_config_dir

from saopd.eval.runner import evaluate_benchmark, load_benchmark
from saopd.evaluate import CONF_DIR, run_eval
from saopd.rollout.base import Rollout, RolloutBatch, SamplingParams
from tests.helpers.mlflow_store import sqlite_store

REPO = Path(CONF_DIR).parent


class ScriptedEngine:
    """Answers problem i's sample j with the gold when ``right(i, j)``, else with a wrong one."""

    def __init__(self, tokenizer, problems, right) -> None:
        self.tok, self.problems, self.right = tokenizer, problems, right
        self.offset = 0

    def generate(self, messages, sampling):
        batch = RolloutBatch(messages=list(messages))
        for i, _ in enumerate(messages):
            gold = self.problems[self.offset + i].answer
            for j in range(sampling.n):
                answer = gold if self.right(self.offset + i, j) else f"{gold}1"
                text = f"Let me think. 2 + 2 = 4. So the answer is \\boxed{{{answer}}}."
                batch.rollouts.append(Rollout(i, self.tok.encode(text), finished=True))
        self.offset += len(messages)
        return batch

    def load_weights(self, named_tensors) -> None:  # pragma: no cover - protocol
        pass


def test_avg_at_k_is_the_mean_per_problem_fraction(qwen_tok) -> None:
    problems = load_benchmark("gsm8k", REPO / "data", limit=4)
    # problem 0: 2/2 right, 1: 1/2, 2: 0/2, 3: 1/2 -> Avg@2 = (1 + .5 + 0 + .5) / 4 = 0.5
    table = {(0, 0), (0, 1), (1, 0), (3, 1)}
    engine = ScriptedEngine(qwen_tok, problems, lambda i, j: (i, j) in table)
    res = evaluate_benchmark("gsm8k", problems, engine, qwen_tok, SamplingParams(n=2),
                             batch_size=3, grade_workers=1)
    assert res.score == pytest.approx(0.5)
    assert res.problems == 4 and len(res.samples) == 8
    by_key = {(s["id"], s["sample"]): s for s in res.samples}
    assert by_key[(problems[0].id, 1)]["correct"] is True
    assert by_key[(problems[2].id, 0)]["correct"] is False
    assert by_key[(problems[0].id, 0)]["extracted"] == problems[0].answer


def test_missing_files_and_bad_rows_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"aime24\.jsonl; run `dvc repro prepare_eval`"):
        load_benchmark("aime24", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"vlm_eval/countqa\.jsonl; run `dvc repro "
                                                r"prepare_vlm_eval`"):
        load_benchmark("countqa", tmp_path / "eval")
    bad = tmp_path / "amc23.jsonl"
    bad.write_text('{"id": "1", "messages": []}\n')
    with pytest.raises(ValueError, match=r"amc23.jsonl: row 1 lacks field\(s\) \['answer'\]"):
        load_benchmark("amc23", tmp_path)


def compose_eval(tmp: Path, *overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("eval", overrides=[
            f"data_dir={REPO / 'data' / 'prepared' / 'eval'}", f"output_dir={tmp / 'eval'}",
            f"tracking_uri={sqlite_store(tmp / 'mlflow.db')}", *overrides])


def test_saopd_eval_on_a_tiny_model_writes_samples_and_logs(tmp_path: Path,
                                                             monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # artifacts must not follow the working directory
    cfg = compose_eval(tmp_path, "model=tiny_qwen3",  # a config group, as users choose it
                       "benchmarks=[gsm8k]", "limit=3", "k=2", "+max_new_tokens.gsm8k=8",
                       "grade_workers=1")
    out = run_eval(cfg)
    res = out["benchmarks"]["gsm8k"]
    assert res["problems"] == 3 and res["k"] == 2 and 0.0 <= res["score"] <= 1.0
    rows = [json.loads(x) for x in Path(res["samples_file"]).read_text().splitlines()]
    assert len(rows) == 6 and all(r["tokens"] <= 8 for r in rows)
    assert {"id", "sample", "response", "extracted", "correct", "gold"} <= rows[0].keys()
    saved = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert saved["benchmarks"]["gsm8k"]["score"] == res["score"]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    history = client.get_metric_history(out["run_id"], "eval/gsm8k/avg_at_2")
    assert [m.value for m in history] == [res["score"]]
    # the new experiment keeps its artifacts beside the store, not in ./mlartifacts
    experiment = client.get_experiment(client.get_run(out["run_id"]).info.experiment_id)
    assert experiment.artifact_location == (tmp_path / "mlartifacts" / "eval").as_uri()
    logged = (tmp_path / "mlartifacts" / "eval" / out["run_id"] / "artifacts" / "eval"
              / "step_000000")
    assert {p.name for p in logged.iterdir()} == {"gsm8k.jsonl", "results.json"}
    assert not (elsewhere / "mlartifacts").exists()


def test_saopd_eval_builds_its_engine_through_the_registry(tmp_path: Path, monkeypatch) -> None:
    """The default engine is HF generate, built by build_engine with the run's seed and chat
    template variables (text models get them too); the sampling is the config's."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import saopd.evaluate as evaluate
    import saopd.rollout.registry as registry
    from saopd.config.rollout import HFRolloutConfig
    from saopd.rollout.hf import HFGenerateEngine

    calls: list[tuple] = []
    real = registry.build_engine

    def recording(conf, student, tokenizer, **setup):
        engine = real(conf, student, tokenizer, **setup)
        calls.append((conf, setup, engine))
        return engine

    monkeypatch.setattr(evaluate, "build_engine", recording)
    cfg = compose_eval(tmp_path, "model=tiny_qwen3", "benchmarks=[gsm8k]", "limit=2", "k=1",
                       "log_to_mlflow=false", "+max_new_tokens.gsm8k=4", "seed=3",
                       "+chat_template_kwargs.enable_thinking=false")
    out = run_eval(cfg)
    (conf, setup, engine), = calls
    assert type(conf) is HFRolloutConfig and isinstance(engine, HFGenerateEngine)
    assert setup["seed"] == 3 and setup["processor"] is None
    assert engine.chat_template_kwargs == {"enable_thinking": False}
    rows = [json.loads(x) for x in
            Path(out["benchmarks"]["gsm8k"]["samples_file"]).read_text().splitlines()]
    assert len(rows) == 2 and all(1 <= r["tokens"] <= 4 for r in rows)


def test_saopd_eval_samples_with_the_engine_the_rollout_group_picks(tmp_path: Path,
                                                                   monkeypatch, qwen_tok) -> None:
    """``rollout=vllm`` reaches build_engine with its own config; the engine is closed after."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import saopd.evaluate as evaluate
    from saopd.config.rollout import VLLMRolloutConfig

    seen: list = []

    class Closing(ScriptedEngine):
        closed = False

        def close(self) -> None:
            self.closed = True

    def fake_build(conf, student, tokenizer, **setup):
        problems = load_benchmark("gsm8k", REPO / "data", limit=2)
        seen.append((conf, Closing(tokenizer, problems, lambda i, j: i == 0)))
        return seen[-1][1]

    monkeypatch.setattr(evaluate, "build_engine", fake_build)
    cfg = compose_eval(tmp_path, "model=tiny_qwen3", "rollout=vllm",
                       "rollout.gpu_memory_utilization=0.5", "benchmarks=[gsm8k]", "limit=2",
                       "k=1", "log_to_mlflow=false", "grade_workers=1")
    out = run_eval(cfg)
    (conf, engine), = seen
    assert type(conf) is VLLMRolloutConfig and conf.gpu_memory_utilization == 0.5
    assert engine.closed
    assert out["benchmarks"]["gsm8k"]["score"] == pytest.approx(0.5)


def test_rollout_sampling_keys_are_refused(tmp_path: Path) -> None:
    """saopd-eval samples with its own k/temperature/top_p/max_new_tokens: the rollout group's
    copies would be silently ignored, so setting them is an error naming the key to use."""
    from omegaconf import OmegaConf

    cfg = compose_eval(tmp_path, "rollout.temperature=0.6")
    with pytest.raises(ValueError, match=r"rollout\.temperature is not used by saopd-eval: "
                                         r"set temperature instead"):
        OmegaConf.to_object(cfg)


def test_eval_of_a_training_checkpoint_loads_the_student(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from saopd.evaluate import load_checkpoint_student
    from saopd.train import train
    from tests.conftest import compose_train

    summary = train(compose_train(tmp_path, "experiment=tiny", "steps=1", mlflow=False))
    ckpt = Path(summary["last_checkpoint"])
    (ckpt.parent.parent / ".hydra").mkdir(exist_ok=True)  # what a Hydra run leaves behind
    from omegaconf import OmegaConf

    OmegaConf.save(compose_train(tmp_path, "experiment=tiny"), ckpt.parent.parent / ".hydra"
                   / "config.yaml")
    model, _, step = load_checkpoint_student(ckpt, None)  # type: ignore[arg-type]
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    for name, value in model.state_dict().items():
        if f"student.{name}" in state:
            torch.testing.assert_close(value, state[f"student.{name}"], rtol=0, atol=0)
    assert step == 1


def test_training_time_eval_logs_avg_at_k(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from saopd.train import train
    from tests.conftest import compose_train

    summary = train(compose_train(tmp_path, "experiment=tiny", "steps=2", "eval.every_n_steps=1",
                                  "eval.limit=2", "eval.max_new_tokens=8"))
    client = mlflow.MlflowClient(summary["tracking_uri"])
    history = client.get_metric_history(summary["run_id"], "eval/gsm8k/avg_at_1")
    assert sorted(m.step for m in history) == [0, 1]
    assert all(0.0 <= m.value <= 1.0 for m in history)
    assert (Path(summary["output_dir"]) / "eval" / "step_000001" / "gsm8k.jsonl").is_file()


def test_eval_before_the_first_step_and_after_the_last(tmp_path: Path, monkeypatch,
                                                       capsys) -> None:
    """``eval.at_start``: the untrained student is evaluated once before step 0 (index -1, its
    samples exactly those of evaluating the initial model directly), training is not changed by
    it (same final weights as without), the last step is evaluated off the every-N grid, and
    ``saopd-train`` prints the first and last scores."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from saopd.train import format_summary, train
    from tests.conftest import compose_train

    args = ("experiment=tiny", "steps=3", "eval.every_n_steps=2", "eval.limit=2",
            "eval.max_new_tokens=8", "eval.top_p=1.0")
    summary = train(compose_train(tmp_path / "a", *args, "eval.at_start=true"))
    client = mlflow.MlflowClient(summary["tracking_uri"])
    history = client.get_metric_history(summary["run_id"], "eval/gsm8k/avg_at_1")
    assert sorted(m.step for m in history) == [-1, 1, 2]  # before, after step 2, after step 3
    assert list(summary["eval"]) == ["-1", "1", "2"]
    out = Path(summary["output_dir"])
    initial = [json.loads(x) for x in (out / "eval" / "initial" / "gsm8k.jsonl").open()]

    from saopd.config import to_train_config
    from saopd.config.rollout import HFRolloutConfig
    from saopd.models.factory import build_pair
    from saopd.rollout.registry import build_engine

    conf = to_train_config(compose_train(tmp_path / "c", *args))
    pair = build_pair(conf.student, conf.teacher)  # the initial student, as the trainer has it
    problems = load_benchmark("gsm8k", conf.eval.data_dir, limit=2)
    engine = build_engine(HFRolloutConfig(batch_size=8), pair.student, pair.tokenizer)
    direct = evaluate_benchmark("gsm8k", problems, engine, pair.tokenizer,
                                SamplingParams(n=1, temperature=1.0, top_p=1.0, max_new_tokens=8,
                                               seed=conf.seed), batch_size=8)
    assert [x["response"] for x in initial] == [x["response"] for x in direct.samples]

    plain = train(compose_train(tmp_path / "b", *args))
    assert list(plain["eval"]) == ["1", "2"]
    ckpt = lambda s: torch.load(s["last_checkpoint"], weights_only=False)["state_dict"]  # noqa: E731
    a, b = ckpt(summary), ckpt(plain)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)
    text = format_summary(summary)
    # the UI's address opens this experiment's runs in the model-training view
    exp_id = client.get_run(summary["run_id"]).info.experiment_id
    assert summary["mlflow_experiment_id"] == exp_id
    assert (f"then http://127.0.0.1:5000/#/experiments/{exp_id}/runs?"
            "workflowType=machine_learning&compareRunsMode=CHART") in text
    served = format_summary({**summary, "tracking_uri": "http://10.0.0.5:5917/"})
    assert f"browse:      http://10.0.0.5:5917/#/experiments/{exp_id}/runs?workflowType=" in served
    first, last = summary["eval"]["-1"], summary["eval"]["2"]
    assert "held-out (before training -> after step 3):" in text
    assert f"gsm8k/avg_at_1: {first['eval/gsm8k/avg_at_1']:.4g} -> " \
           f"{last['eval/gsm8k/avg_at_1']:.4g}" in text


def test_eval_at_start_needs_periodic_evaluation() -> None:
    from saopd.config.eval import EvalDuringTrainingConfig

    with pytest.raises(ValueError, match=r"at_start needs eval\.every_n_steps"):
        EvalDuringTrainingConfig(every_n_steps=0, at_start=True, data_dir="x")



def test_training_time_eval_builds_its_engine_through_the_registry(tmp_path: Path, tiny_tok,
                                                                   monkeypatch) -> None:
    """EvalCallback: an HF engine from build_engine on the live student, with the run's chat
    template variables for a text student too (the prompts it samples from carry them)."""
    from types import SimpleNamespace

    import saopd.lightning.callbacks as callbacks
    import saopd.rollout.registry as registry
    from saopd.config.rollout import HFRolloutConfig
    from saopd.lightning.callbacks import EvalCallback
    from saopd.models.tiny import tiny_qwen3

    built: list = []
    real = registry.build_engine

    def recording(conf, student, tokenizer, **setup):
        built.append((conf, student, setup, real(conf, student, tokenizer, **setup)))
        return built[-1][-1]

    monkeypatch.setattr(callbacks, "build_engine", recording)
    student = tiny_qwen3(tiny_tok)
    kwargs = {"enable_thinking": False}
    module = SimpleNamespace(student=student, tokenizer=tiny_tok,
                             contexts=SimpleNamespace(processor=None, chat_template_kwargs=kwargs))
    logged: list = []
    trainer = SimpleNamespace(global_step=2, max_steps=10, loggers=[SimpleNamespace(
        log_metrics=lambda metrics, step: logged.append((metrics, step)))])
    problems = {"gsm8k": load_benchmark("gsm8k", REPO / "data", limit=2)}
    callback = EvalCallback(2, problems, SamplingParams(n=1, max_new_tokens=3), tmp_path,
                            batch_size=2)
    callback.on_train_batch_end(trainer, module, None, None, 0)
    (conf, model, setup, engine), = built
    assert conf == HFRolloutConfig(batch_size=2) and model is student
    assert setup == {"chat_template_kwargs": kwargs, "processor": None}
    messages = problems["gsm8k"][0].messages
    # Qwen3's template closes an empty think block only with enable_thinking=false
    assert tiny_tok.decode(engine.prompt_ids(messages)) == tiny_tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert tiny_tok.decode(engine.prompt_ids(messages)).endswith("<think>\n\n</think>\n\n")
    ((metrics, step),) = logged
    assert step == 1 and set(metrics) == {"eval/gsm8k/avg_at_1"}
    assert (tmp_path / "eval" / "step_000001" / "gsm8k.jsonl").is_file()


def test_limit_zero_is_refused_not_scored_as_zero(tmp_path: Path) -> None:
    """``limit=0`` used to log an average of 0.0 over no problem as a FINISHED run (issue 15,
    point 8): it is refused at start-up, as is a benchmark file with no problem."""
    from omegaconf import OmegaConf

    cfg = compose_eval(tmp_path, "model=tiny_qwen3", "limit=0")
    with pytest.raises(ValueError, match=r"limit must be null or an int >= 1, got 0"):
        OmegaConf.to_object(cfg)
    data_dir = tmp_path / "prepared"
    data_dir.mkdir()
    (data_dir / "math500.jsonl").write_text("")
    problems = load_benchmark("math500", data_dir)
    with pytest.raises(ValueError, match=r"benchmark 'math500': no problem to evaluate"):
        evaluate_benchmark("math500", problems, None, None, SamplingParams())


def test_trainer_threads_sets_torchs_threads(tmp_path: Path, monkeypatch) -> None:
    """``trainer.threads``: the training process runs torch on that many threads (and tells
    Lightning's launchers through OMP_NUM_THREADS)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    from saopd.train import train
    from tests.conftest import compose_train

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        train(compose_train(tmp_path, "experiment=tiny", "steps=1", "trainer.threads=1",
                            mlflow=False))
        assert torch.get_num_threads() == 1
        assert os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        torch.set_num_threads(before)
