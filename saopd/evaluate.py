"""``saopd-eval``: Avg@k of a model on registered benchmarks, logged to MLflow.

    saopd-eval model=smollm2_135m_instruct benchmarks=[gsm8k] limit=50 k=1
    saopd-eval checkpoint=outputs/smollm2_gsm8k/<run>/checkpoints/last.ckpt     # a trained student
    saopd-eval run_id=<mlflow run id>      # the run's last checkpoint; results go into that run
    saopd-eval run_id=<id> checkpoint=<run>/checkpoints/step_000100.ckpt   # one of its checkpoints
    saopd-eval model.name_or_path=Qwen/Qwen3-1.7B device=cuda rollout=vllm      # any hub model
    saopd-eval model=tiny_qwen3_5_vl benchmarks=[synth_vqa] k=1 limit=8          # a VLM

Each benchmark is a record of :data:`saopd.eval.benchmarks.BENCHMARKS` (its file, grader, the
paper's k and max new tokens); ``k``, ``k_per_benchmark`` and ``max_new_tokens`` override the
records. Sampling follows the paper (temperature 1.0, top-p 0.95) through the rollout engine the
``rollout`` group picks (``hf``, transformers ``generate``, by default; ``vllm``), built by
:func:`saopd.rollout.registry.build_engine` as in training. The math benchmarks need ``dvc repro
prepare_eval`` (``gsm8k`` reads the vendored test split).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from saopd.config import register_schema
from saopd.config.eval import EvalConfig
from saopd.config.model import ModelConfig
from saopd.config.train import unknown_keys
from saopd.eval.benchmarks import BENCHMARKS
from saopd.eval.runner import evaluate_benchmark, load_benchmark
from saopd.io import write_jsonl_atomic
from saopd.models.factory import build_model, build_vlm
from saopd.paths import conf_dir, register_resolvers, repo_root
from saopd.rollout.base import SamplingParams
from saopd.rollout.registry import build_engine
from saopd.runs.checkpoints import read_checkpoint
from saopd.runs.resume import CHECKPOINT_IDENTITY_KEY
from saopd.runs.tracking import (
    FOLDER_TAG,
    check_tracking_server,
    default_tracking_uri,
    local_artifact_location,
    store_lock,
)
from saopd.runs.ui import get_or_create_experiment

if TYPE_CHECKING:
    from saopd.rollout.base import SamplingParams

log = logging.getLogger("saopd.eval")
CONF_DIR = str(conf_dir())


def load_judge(spec: str | None) -> Any:
    """The callable named by ``"package.module:attribute"`` (``mmifeval_judge``), None for None.

    Raises ``ValueError`` for a malformed spec or an attribute that is not callable."""
    if spec is None:
        return None
    import importlib

    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"mmifeval_judge must be 'module:callable', got {spec!r}")
    judge = getattr(importlib.import_module(module), attr)
    if not callable(judge):
        raise ValueError(f"mmifeval_judge {spec!r} is not callable")
    return judge


def _run_config(run_dir: Path) -> DictConfig | None:
    """The training run's saved config (``<run>/.hydra/config.yaml``), None when absent."""
    saved = run_dir / ".hydra" / "config.yaml"
    if not saved.is_file():
        return None
    cfg = OmegaConf.load(saved)
    assert isinstance(cfg, DictConfig)
    return cfg


def _student_from_run(run_dir: Path, fallback: ModelConfig) -> ModelConfig:
    cfg = _run_config(run_dir)
    if cfg is None:
        log.warning("no saved config in %s; using the model group's config", run_dir)
        return fallback
    return ModelConfig(**OmegaConf.to_container(cfg.student, resolve=False))


def eval_chat_template_kwargs(given: Mapping[str, Any], ckpt: Path | None, *,
                              from_run: bool = True) -> dict[str, Any]:
    """The chat-template variables ``saopd-eval`` renders prompts with.

    With ``from_run`` and a training checkpoint ``ckpt`` (``<run>/checkpoints/<name>.ckpt``),
    the run's ``data.chat_template_kwargs`` (read from ``<run>/.hydra/config.yaml``; none when
    that file is absent), updated key by key with ``given`` (``chat_template_kwargs``); else
    ``given`` alone. So a paper student trained in non-thinking mode (``{enable_thinking:
    false}``) is evaluated in it too, with no option to remember.
    """
    out: dict[str, Any] = {}
    cfg = _run_config(ckpt.parent.parent) if from_run and ckpt is not None else None
    if cfg is not None:
        saved = OmegaConf.select(cfg, "data.chat_template_kwargs", default=None)
        if saved is not None:
            out.update(OmegaConf.to_container(saved, resolve=True))  # type: ignore[arg-type]
    out.update(given)
    return out


def _build(cfg: ModelConfig) -> tuple[Any, Any, Any]:
    """Model, tokenizer and (for vision-language models) processor, else None."""
    if cfg.is_vision:
        model, processor = build_vlm(cfg)
        return model, processor.tokenizer, processor
    model, tokenizer = build_model(cfg)
    return model, tokenizer, None


def load_checkpoint_student(ckpt: Path, model_cfg: ModelConfig, *, run_id: str | None = None
                            ) -> tuple[Any, Any, int]:
    """Build the run's student architecture and load a checkpoint's student weights (refused
    when it is not the checkpoint of MLflow run ``run_id``, when given)."""
    model, tokenizer, _, step = _load_student(ckpt, model_cfg, run_id=run_id)
    return model, tokenizer, step


def _load_student(ckpt: Path, model_cfg: ModelConfig, *, run_id: str | None = None,
                  owner_required: bool = False) -> tuple[Any, Any, Any, int]:
    """:func:`load_checkpoint_student` plus the processor of a vision-language student.

    ``run_id``: the MLflow run the results go to; a checkpoint that records another MLflow run
    is refused (its scores would be logged into a run that did not train it), and so is one
    that records no MLflow run when ``owner_required`` (``checkpoint`` named beside
    ``run_id``: nothing says that run trained it)."""
    if not ckpt.is_file():
        raise FileNotFoundError(f"checkpoint: no such file {ckpt}")
    # verified (checksum or stored digest, finite), weights only: no pickle payload runs
    state = read_checkpoint(ckpt)
    owner = state.get(CHECKPOINT_IDENTITY_KEY)
    recorded = owner.get("run_id") if isinstance(owner, Mapping) else None
    if run_id is not None and isinstance(owner, Mapping) and recorded != run_id:
        raise ValueError(f"checkpoint {ckpt} was trained by MLflow run {recorded}, not "
                         f"{run_id}: its scores would be logged into a run that did not train "
                         "it (give checkpoint= alone for a new eval run, or run_id= alone for "
                         "that run's last.ckpt)")
    if run_id is not None and owner_required and recorded is None:
        raise ValueError(f"checkpoint {ckpt} records no MLflow run, so nothing says run "
                         f"{run_id} trained it: give checkpoint= alone for a new eval run, or "
                         "run_id= alone for that run's last.ckpt")
    cfg = _student_from_run(ckpt.parent.parent, model_cfg)
    model, tokenizer, processor = _build(cfg)
    student = {k[len("student."):]: v for k, v in state["state_dict"].items()
               if k.startswith("student.")}
    missing, unexpected = model.load_state_dict(student, strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise ValueError(f"checkpoint {ckpt} does not fit the student: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    return model.eval(), tokenizer, processor, int(state.get("global_step", 0))


def benchmark_sampling(conf: EvalConfig, name: str) -> SamplingParams:
    """How benchmark ``name`` is sampled: k and max new tokens from its record
    (:data:`saopd.eval.benchmarks.BENCHMARKS`) unless ``conf`` overrides them (k:
    ``k_per_benchmark[name]``, else ``k``; ``max_new_tokens[name]``), temperature, top-p and
    seed from ``conf``. Raises ``ValueError`` for an unknown name (listing the registered ones).
    """
    record = BENCHMARKS.get(name)
    k = conf.k_per_benchmark.get(name, record.k if conf.k is None else conf.k)
    return SamplingParams(n=k, temperature=conf.temperature, top_p=conf.top_p,
                          max_new_tokens=conf.max_new_tokens.get(name, record.max_new_tokens),
                          seed=conf.seed)


def run_eval(cfg: DictConfig) -> dict[str, Any]:
    """Evaluate; returns {benchmark: score, ...} plus paths. Writes per-sample JSONL files.

    Unknown benchmark names (in ``benchmarks`` or an override) fail before the model is built.
    """
    from tqdm.auto import tqdm


    unknown = unknown_keys(cfg, EvalConfig)
    if unknown:  # a `+key` the schema lacks would be kept by OmegaConf and dropped silently
        raise ValueError("unknown config key(s): " + "; ".join(unknown))
    conf: EvalConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    for name in (*conf.benchmarks, *conf.k_per_benchmark, *conf.max_new_tokens):
        BENCHMARKS.get(name)
    out_dir = Path(conf.output_dir)
    step = 0
    tracking_uri = conf.tracking_uri
    if conf.log_to_mlflow or conf.run_id:  # a server that does not answer: before the model
        check_tracking_server(tracking_uri)
    ckpt = Path(conf.checkpoint) if conf.checkpoint else None
    if conf.run_id and ckpt is None:
        import mlflow

        client = mlflow.MlflowClient(tracking_uri)
        run = client.get_run(conf.run_id)
        # the folder that last trained the run (it may have moved since it started)
        folder = run.data.tags.get(FOLDER_TAG) or run.data.params["paths.output_dir"]
        ckpt = Path(folder) / "checkpoints" / "last.ckpt"
    if ckpt is not None:
        # run_id and checkpoint both given: the named checkpoint, which must record that run
        model, tokenizer, processor, step = _load_student(
            ckpt, conf.model, run_id=conf.run_id,
            owner_required=bool(conf.run_id and conf.checkpoint))
    else:
        model, tokenizer, processor = _build(conf.model)
    judge = load_judge(conf.mmifeval_judge)
    template_kwargs = eval_chat_template_kwargs(conf.chat_template_kwargs, ckpt,
                                                from_run=conf.chat_template_from_run)
    if template_kwargs:
        log.info("chat template variables: %s", template_kwargs)
    model.to(conf.device)
    engine = build_engine(conf.rollout, model, tokenizer, seed=conf.seed,
                          chat_template_kwargs=template_kwargs, processor=processor)
    results: dict[str, Any] = {}
    try:
        for name in conf.benchmarks:
            if BENCHMARKS.get(name).modality == "vision" and processor is None:
                raise ValueError(f"benchmark {name!r} has images: evaluate a vision-language "
                                 "model (a model config with a processor)")
            problems = load_benchmark(name, conf.data_dir, limit=conf.limit)
            sampling = benchmark_sampling(conf, name)
            started = time.perf_counter()
            with tqdm(total=len(problems), desc=f"{name} avg@{sampling.n}",
                      unit="problem") as bar:
                res = evaluate_benchmark(name, problems, engine, tokenizer, sampling,
                                         batch_size=conf.batch_size,
                                         grade_workers=conf.grade_workers,
                                         progress=bar.update, judge=judge)
            path = out_dir / f"{name}.jsonl"
            write_jsonl_atomic(path, res.samples)
            results[name] = {"score": res.score, "k": res.k, "problems": res.problems,
                             "max_new_tokens": sampling.max_new_tokens,
                             "unfinished": res.unfinished, "samples_file": str(path),
                             "ungraded": res.ungraded,
                             "ungraded_constraints": res.ungraded_constraints,
                             "seconds": round(time.perf_counter() - started, 1)}
            log.info("%s: avg@%d = %.4f over %d problems", name, res.k, res.score, res.problems)
    finally:
        close = getattr(engine, "close", None)  # engines with their own copy (vLLM) free it
        if callable(close):
            close()
    average = sum(r["score"] for r in results.values()) / max(1, len(results))
    summary = {"benchmarks": results, "average": average, "step": step,
               "checkpoint": str(ckpt) if ckpt else None, "output_dir": str(out_dir),
               "chat_template_kwargs": template_kwargs}
    (out_dir / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    if conf.log_to_mlflow:
        summary["run_id"] = _log_mlflow(conf, summary, out_dir, tracking_uri)
    return summary


def _log_mlflow(conf: EvalConfig, summary: dict[str, Any], out_dir: Path,
                tracking_uri: str | None) -> str:
    """Log scores and files into ``conf.run_id``, or a new run of ``conf.experiment_name``
    (created if missing; in a local SQLite store with its artifacts beside the store file)."""
    import mlflow


    uri = tracking_uri or default_tracking_uri(repo_root())
    client = mlflow.MlflowClient(uri)
    run_id = conf.run_id
    if run_id is None:
        name = conf.experiment_name
        with store_lock(uri):
            exp_id = get_or_create_experiment(
                client, name, artifact_location=local_artifact_location(uri, name))
            run_id = client.create_run(exp_id, run_name=f"eval-{'-'.join(conf.benchmarks)}"
                                       ).info.run_id
    step = summary["step"]
    for name, res in summary["benchmarks"].items():
        client.log_metric(run_id, f"eval/{name}/avg_at_{res['k']}", res["score"], step=step)
    client.log_metric(run_id, "eval/average", summary["average"], step=step)
    for path in sorted(out_dir.glob("*.json*")):
        client.log_artifact(run_id, str(path), f"eval/step_{step:06d}")
    if conf.run_id is None:
        client.set_terminated(run_id)
    return run_id


register_schema()
register_resolvers()


def run_job(cfg: DictConfig) -> None:
    """The job of ``saopd-eval`` (:func:`saopd.cli.eval_app`): :func:`run_eval`, its scores
    printed; a problem with the config or the inputs exits with status 2 and one line."""
    try:
        summary = run_eval(cfg)
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"saopd-eval: error: {err}", file=sys.stderr)
        sys.exit(2)
    for name, res in summary["benchmarks"].items():
        print(f"{name:14s} avg@{res['k']:<3d} {res['score']:.4f}  ({res['problems']} problems, "
              f"{res['unfinished']} unfinished samples"
              + (f", {res['ungraded']} ungraded samples, {res['ungraded_constraints']} ungraded "
                 "constraints: no judge" if res.get("ungraded_constraints") else "") + ")")
    print(f"{'average':14s}        {summary['average']:.4f}")
    print(f"per-sample results: {summary['output_dir']}")
    if "run_id" in summary:
        print(f"MLflow run: {summary['run_id']}")

