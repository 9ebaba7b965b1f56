"""``saopd-train``: compose the Hydra config, build everything, train with Lightning.

    saopd-train                                   # the default CPU experiment (smollm2_gsm8k)
    saopd-train experiment=tiny                   # random tiny models, < 1 minute
    saopd-train filter=none                       # vanilla OPD on the same setup
    saopd-train filter.beta_max=0.018 seed=1      # SA-OPD with the adaptive FLMR bound
    saopd-train resume=auto                       # continue the latest run of the experiment
    saopd-train -m filter=sa_opd,none seed=0,1    # a sweep (Hydra multirun)
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import hydra
import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig

import saopd.testbeds  # noqa: F401  (registers the planted-prior model wrapper)
from saopd.config import TrainConfig, register_schema, to_train_config
from saopd.contexts import context_builder
from saopd.eval.runner import load_benchmark
from saopd.filters import build_filter
from saopd.lightning.callbacks import EvalCallback, RolloutCallback, TokenViewCallback
from saopd.lightning.data import PromptDataModule
from saopd.lightning.module import OPDModule
from saopd.lightning.resume import (
    RUN_RECORD,
    RunIdentityCallback,
    RunPlan,
    claimed_by,
    config_digest,
    plan_run,
    write_run_record,
)
from saopd.lightning.runs import (
    FiniteGuard,
    NonFiniteError,
    PreemptionCheckpoint,
    RunLock,
    check_resume_config,
    schema_defaults,
    training_config,
    write_training_config,
)
from saopd.lightning.trainer import build_trainer, checkpoint_callback
from saopd.mlflow_ui import get_or_create_experiment
from saopd.models.factory import ModelPair, build_pair, build_student_for_service
from saopd.objectives import build_objective
from saopd.paths import conf_dir, register_resolvers
from saopd.prompts.sources import load_prompts
from saopd.rollout import RolloutEngine, SamplingParams, build_engine, holds_weights
from saopd.scoring.teacher_service import (
    TeacherScorer,
    TeacherServiceError,
    VLLMServerTeacherScorer,
    VLLMTeacherScorer,
    check_servable,
)
from saopd.sweeps import is_multirun, record_job_failure, sweep_tags
from saopd.tracking import (
    FOLDER_TAG,
    RUN_UID_TAG,
    default_tracking_uri,
    log_params,
    log_resolved_config,
    make_mlflow_logger,
    read_run_tags,
    store_lock,
)

T = TypeVar("T")

log = logging.getLogger("saopd.train")
CONF_DIR = str(conf_dir())


class UserError(Exception):
    """A problem with the user's configuration or inputs: reported without a traceback."""


# Intentional here: the frozen teacher stays in eval mode; checkpoints hold the weights after
# each step's optimizer update (manual optimization), which is what resuming needs; and the prompt
# loader needs no saved state to resume mid-epoch (a step's batch is a function of the step).
for _pattern in (r".*module\(s\) in eval mode.*", r".*pre-optimization state was saved.*",
                 r".*your dataloader is not resumable.*"):
    warnings.filterwarnings("ignore", message=_pattern)


def train(cfg: DictConfig, extra_callbacks: list[L.Callback] | None = None) -> dict[str, Any]:
    """Run one training job; returns a summary (paths, MLflow run, final metrics).

    Builds, each through its registry or factory: filter and objective (``conf.filter`` /
    ``conf.objective``), the teacher/student pair (:func:`saopd.models.factory.build_pair`), the
    prompts (:func:`saopd.prompts.sources.load_prompts`), the rollout engine
    (:func:`saopd.rollout.registry.build_engine`), the step's context builder
    (:func:`saopd.contexts.context_builder`), then the module and the ``Trainer``.
    ``extra_callbacks`` are added to the Trainer's (profilers, custom logging, fault injection).
    """
    conf = _checked("config", to_train_config, cfg)
    L.seed_everything(conf.seed, workers=True, verbose=False)
    token_filter = _checked("config group 'filter'", _build_variant, build_filter, conf.filter)
    objective = _checked("config group 'objective'", _build_variant, build_objective,
                         conf.objective)
    zero = _global_rank() == 0  # under DDP/FSDP every rank runs this function
    run_config = training_config(dataclasses.asdict(conf))
    # the checkpoint (verified: checksum or stored digest, weights only, finite), its run folder
    # and whose it is: the run's own, a moved folder, a copy (a new run) or another run's
    # resume=auto in a sweep job continues its own folder only, never another job's run
    plan = _checked("resume", plan_run, conf, run_config, own_folder_only=is_multirun())
    if plan.checkpoint is not None:
        log.info("resume (%s): %s at step %s, in %s", plan.how, plan.checkpoint, plan.step,
                 plan.folder)
    out_dir = plan.folder
    out_dir.mkdir(parents=True, exist_ok=True)
    changes = (_checked("resume", check_resume_config, plan.recorded_config, run_config,
                        (*conf.resume_changes, "steps"), schema_defaults(conf),
                        source=plan.config_source)
               if plan.checkpoint is not None else {})
    lock = _checked("run", RunLock(out_dir).acquire) if zero else None  # one writer per run
    try:
        return _train(cfg, conf, token_filter, objective, plan, run_config, changes,
                      extra_callbacks)
    finally:
        if lock is not None:
            lock.release()


def _train(cfg: DictConfig, conf: TrainConfig, token_filter: Any, objective: Any,
           plan: RunPlan, run_config: dict[str, str],
           changes: dict[str, tuple[str, str]], extra_callbacks: list[L.Callback] | None
           ) -> dict[str, Any]:
    """The rest of :func:`train`, with the run folder locked."""
    ckpt, out_dir = plan.checkpoint, plan.folder
    if conf.trainer.threads:
        torch.set_num_threads(conf.trainer.threads)
        # Lightning's DDP/FSDP set each process's threads unless OMP_NUM_THREADS is set
        os.environ["OMP_NUM_THREADS"] = str(conf.trainer.threads)
    zero = _global_rank() == 0
    if zero and (plan.how in ("new", "copied", "from_checkpoint") or changes
                 or not (out_dir / "saopd_config.json").is_file()):
        write_training_config(out_dir, run_config)
    if zero:
        plan.identity.config_sha256 = config_digest(run_config)
        _checked("run", write_run_record, out_dir, plan.identity)
    if zero and changes:
        _record_resume_changes(out_dir, changes)

    started = time.perf_counter()
    service = conf.teacher_scoring.backend != "hf"
    if service:  # refused before anything is loaded
        _checked("teacher_scoring", check_servable,
                 {f"filter={conf.filter['name']}": token_filter,
                  f"objective={conf.objective['name']}": objective},
                 conf.teacher_scoring.backend, conf.teacher_scoring.top_k)
        pair = _checked("models", build_student_for_service, conf.student, conf.teacher,
                        chat_template_kwargs=conf.data.chat_template_kwargs,
                        teacher_contexts=conf.teacher_contexts,
                        teacher_folder=conf.teacher_scoring.backend == "vllm",
                        folder_parent=conf.teacher_scoring.model_dir)
    else:
        pair = _checked("models", build_pair, conf.student, conf.teacher,
                        chat_template_kwargs=conf.data.chat_template_kwargs,
                        teacher_contexts=conf.teacher_contexts)
    log.info("models ready in %.1f s; tokenizers: %s", time.perf_counter() - started,
             pair.vocab.describe(conf.teacher_contexts))
    contexts_record = {"choice": conf.teacher_contexts, "pair_kind": pair.vocab.kind,
                       "scored": pair.scored_contexts}
    records, data_counts = _checked("data", load_prompts, conf.data, pair.tokenizer,
                                    pair.processor)
    engine = _checked(
        "rollout", build_engine, conf.rollout, pair.student, pair.tokenizer,
        max_prompt_length=conf.data.max_prompt_length,
        prompt_truncation="truncate" if conf.data.long_prompts == "truncate" else "error",
        seed=conf.seed, devices=conf.trainer.devices, num_nodes=conf.trainer.num_nodes,
        chat_template_kwargs=conf.data.chat_template_kwargs, processor=pair.processor)
    # from here on the engine is closed whatever happens: an engine with its own copy of the
    # model (vLLM) must free it, since sweeps run their jobs in one process
    scorer: TeacherScorer | None = None
    try:
        if service:
            scorer = _checked("teacher_scoring", _build_scorer, conf, pair)
            log.info("teacher scoring: %s (the trainer holds no teacher weights)",
                     conf.teacher_scoring.backend)
        module = OPDModule(
            student=pair.student, teacher=pair.teacher, teacher_scorer=scorer,
            tokenizer=pair.tokenizer,
            token_filter=token_filter, objective=objective,
            reference=copy.deepcopy(pair.student) if "lp_ref" in objective.needs else None,
            optim=conf.optim, step=conf.step, total_steps=conf.steps,
            vocab_size=pair.vocab.common_logits,
            activation_checkpointing=conf.trainer.activation_checkpointing,
            fsdp_mixed_precision=conf.trainer.fsdp_mixed_precision,
            contexts=context_builder(
                pair.tokenizer, pair.processor, residual_remove=conf.data.residual_remove,
                chat_template_kwargs=conf.data.chat_template_kwargs,
                teacher_tokenizer=(pair.teacher_tokenizer if pair.scored_contexts == "own"
                                   else None),
                response_id_map=pair.vocab.response_id_map))
        data = PromptDataModule(records, prompts_per_step=conf.prompts_per_step,
                                num_steps=conf.steps, seed=conf.seed, shuffle=conf.data.shuffle)
        # Under DDP/FSDP every rank runs this function; only global rank 0 tracks the run.
        loggers, run_info = (_checked("logger", _make_logger, conf, plan) if zero
                             else ([], {}))
        if loggers:  # the record names the MLflow run now
            _checked("run", write_run_record, out_dir, plan.identity)
        if loggers and changes:
            loggers[0].experiment.set_tag(loggers[0].run_id, "saopd.resume_changes",
                                          json.dumps(changes)[:5000])
        trainer = _checked("trainer", build_trainer, conf, out_dir, loggers=loggers,
                           callbacks=[*_callbacks(conf, engine, out_dir),
                                      RunIdentityCallback(plan.identity, run_config),
                                      *(extra_callbacks or [])])
        if loggers:  # what the teacher scored (the choice itself is the config's param)
            log_params(loggers[0], {f"teacher_contexts.{k}": v
                                    for k, v in contexts_record.items() if k != "choice"})
        if loggers and run_info.get("new_mlflow_run"):
            log_resolved_config(loggers[0], cfg)
            for name, value in data_counts.items():
                loggers[0].log_metrics({f"data/{name}": float(value)}, step=0)
        run_info.pop("new_mlflow_run", None)
        try:
            trainer.fit(module, datamodule=data, ckpt_path=str(ckpt) if ckpt else None)
        except NonFiniteError as err:
            raise UserError(str(err)) from None
        except TeacherServiceError as err:  # a teacher server failed mid-run: say which
            raise UserError(f"teacher_scoring: {err}") from None
        except (ValueError, OSError) as err:  # a fault met inside the loop (a full disk, a
            # checkpoint refused on load): one line, as before the loop; the traceback to the log
            log.debug("training stopped", exc_info=True)
            raise UserError(f"training stopped after {trainer.global_step} steps: "
                            f"{err}") from None
    finally:
        if scorer is not None:
            scorer.close()
        close = getattr(engine, "close", None)
        if callable(close):
            close()

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    evals = next((cb.results for cb in trainer.callbacks if isinstance(cb, EvalCallback)), {})
    summary = {"output_dir": str(out_dir), "steps": trainer.global_step, **run_info,
               "last_checkpoint": str(out_dir / "checkpoints" / "last.ckpt"),
               "metrics": metrics, "data": data_counts, "teacher_contexts": contexts_record,
               "eval": {str(step): evals[step] for step in sorted(evals)},
               "seconds": round(time.perf_counter() - started, 1)}
    if trainer.is_global_zero:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _build_scorer(conf: TrainConfig, pair: ModelPair) -> TeacherScorer:
    """The teacher-scoring service of ``conf.teacher_scoring`` (``vllm`` | ``vllm_server``)."""
    ts = conf.teacher_scoring
    if ts.backend == "vllm_server":
        # checked against the teacher's config, tokenizer and weight files; the key file read
        return VLLMServerTeacherScorer.from_config(ts, conf.teacher, pair.teacher_tokenizer)
    rollout_in_process = conf.rollout.engine == "vllm" and bool(
        getattr(conf.rollout, "in_process", False))
    if ts.in_process and rollout_in_process:
        raise ValueError("teacher_scoring.in_process=true with an in-process rollout=vllm: two "
                         "vLLM engine cores cannot share the training process; set "
                         "teacher_scoring.in_process=false (the default)")
    processes = max(conf.trainer.devices if isinstance(conf.trainer.devices, int) else 1, 1) \
        * max(conf.trainer.num_nodes, 1)
    assert pair.teacher_source is not None
    return VLLMTeacherScorer(
        pair.teacher_source, top_k=ts.top_k,
        dtype=conf.teacher.dtype if ts.dtype == "auto" else ts.dtype,
        max_model_len=ts.max_model_len, gpu_memory_utilization=ts.gpu_memory_utilization,
        kv_cache_gb=ts.kv_cache_gb, enforce_eager=ts.enforce_eager,
        tensor_parallel_size=ts.tensor_parallel_size, in_process=ts.in_process,
        devices=ts.devices, clean_environment=processes > 1, processor=pair.processor,
        max_images_per_prompt=ts.max_images_per_prompt, seed=conf.seed,
        owned_dir=pair.teacher_source_owned)


def _checked(what: str, build: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``build(*args, **kwargs)``; a ``ValueError``, ``OSError`` or ``ImportError`` (bad input,
    a missing file or package) becomes a :class:`UserError` prefixed ``what:``."""
    try:
        return build(*args, **kwargs)
    except (ValueError, OSError, ImportError) as err:
        raise UserError(f"{what}: {err}") from None


def _build_variant(build: Callable[..., T], params: Mapping[str, Any]) -> T:
    """A filter or objective from its config mapping (``name`` + hyperparameters)."""
    params = dict(params)
    return build(params.pop("name"), **params)


def _callbacks(conf: TrainConfig, engine: RolloutEngine, out_dir: Path) -> list[L.Callback]:
    """Rollouts each step, checkpoints, and the optional token views and evaluation."""
    sampling = SamplingParams(n=conf.rollout.n, temperature=conf.rollout.temperature,
                              top_p=conf.rollout.top_p, max_new_tokens=conf.rollout.max_new_tokens,
                              seed=conf.seed)
    callbacks: list[L.Callback] = [
        RolloutCallback(engine, sampling, sync_weights=holds_weights(engine),
                        async_steps=conf.rollout.async_steps),
        checkpoint_callback(conf, out_dir),
        FiniteGuard(temperature=conf.rollout.temperature),
        PreemptionCheckpoint(out_dir / "checkpoints"),
    ]
    if conf.trainer.view_every_n_steps:
        callbacks.append(TokenViewCallback(conf.trainer.view_every_n_steps, out_dir))
    if conf.eval.every_n_steps:
        callbacks.append(_eval_callback(conf, out_dir))
    return callbacks


def _global_rank() -> int:
    """This process's global rank as the launcher set it (0 before any launch)."""
    return int(getattr(rank_zero_only, "rank", 0) or 0)


def _eval_callback(conf: TrainConfig, out_dir: Path) -> L.Callback:
    try:
        problems = {name: load_benchmark(name, conf.eval.data_dir, limit=conf.eval.limit)
                    for name in conf.eval.benchmarks}
    except (FileNotFoundError, ValueError) as err:
        raise UserError(f"eval: {err}") from None
    sampling = SamplingParams(n=conf.eval.k, temperature=conf.eval.temperature,
                              top_p=conf.eval.top_p, max_new_tokens=conf.eval.max_new_tokens,
                              seed=conf.seed)
    return EvalCallback(conf.eval.every_n_steps, problems, sampling, out_dir,
                        at_start=conf.eval.at_start, batch_size=conf.eval.batch_size,
                        sampler=conf.eval.sampler)


def _make_logger(conf: TrainConfig, plan: RunPlan) -> tuple[list[Any], dict[str, Any]]:
    """The run's MLflow logger: the MLflow run of its record when it continues its own run
    (and that MLflow run is not another folder's), else a new one, tagged with the run it was
    copied or started from. Fills the MLflow fields of ``plan.identity``; the info returned
    says whether the MLflow run is new (``new_mlflow_run``)."""
    if conf.logger.kind == "none":
        return [], {}
    ident = plan.identity
    uri = conf.logger.tracking_uri or ident.tracking_uri or default_tracking_uri(
        conf.paths.root)
    name = conf.logger.experiment_name or conf.experiment_name
    run_name = conf.logger.run_name or (
        f"{conf.experiment_name}-{conf.filter['name']}-{conf.objective['name']}-s{conf.seed}")
    run_id = ident.run_id if plan.continues_mlflow_run else None
    if run_id is not None:  # whose is that MLflow run now? (a copy of a moved folder)
        owner = read_run_tags(uri, run_id) or {}
        if owner.get(RUN_UID_TAG, ident.run_uid) != ident.run_uid:
            plan.as_copy(owner.get(FOLDER_TAG, "?"))
        elif claimed_by(owner.get(FOLDER_TAG), ident.run_uid, plan.folder) is not None:
            plan.as_copy(owner[FOLDER_TAG])
        if plan.how == "copied":
            log.warning("resume: MLflow run %s is another folder's (%s): this run logs to a "
                        "new MLflow run", run_id, owner.get(FOLDER_TAG))
            ident, run_id = plan.identity, None
    own = {RUN_UID_TAG: ident.run_uid, FOLDER_TAG: str(plan.folder.absolute())}
    if ident.copied_from:
        parent = ident.copied_from
        own.update({"saopd.copied_from": parent.get("run_id") or parent["run_uid"],
                    "saopd.copied_from_folder": str(parent.get("folder"))})
        if parent.get("checkpoint"):
            own["saopd.copied_from_checkpoint"] = str(parent["checkpoint"])
    logger = make_mlflow_logger(experiment_name=name, tracking_uri=uri, run_name=run_name,
                                run_id=run_id, tags={**_run_tags(conf), **own},
                                root=Path(conf.paths.root))
    if run_id is not None:  # a continued run: it is this folder's now
        for key, value in own.items():
            logger.experiment.set_tag(run_id, key, value)
    ident.run_id, ident.tracking_uri, ident.mlflow_experiment = logger.run_id, uri, name
    return [logger], {"tracking_uri": uri, "mlflow_experiment": name, "run_id": logger.run_id,
                      "new_mlflow_run": run_id is None}


register_schema()
register_resolvers()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def main(cfg: DictConfig) -> dict[str, Any] | None:
    """Hydra entry point (``saopd-train``); returns the run's summary (None if it failed).

    A single run that fails exits with status 2 (configuration) or re-raises. In a sweep
    (``-m``) a failed job is recorded (``FAILED.json``, a FAILED MLflow run) and the sweep goes
    on; :class:`saopd.sweeps.SweepSummary` reports the failures when the sweep ends.
    """
    try:
        summary = train(cfg)
    except SIGTERMException:  # preempted: the step is saved (PreemptionCheckpoint); say so
        _record_stopped_job(cfg)
        print("saopd-train: stopped by SIGTERM; the last step is in checkpoints/last.ckpt: "
              "continue with resume=auto (or resume=<run folder>)", file=sys.stderr)
        sys.exit(143)
    except Exception as err:
        if is_multirun():
            _record_failed_job(cfg, err)
            return None
        if not isinstance(err, UserError):
            raise
        log.error("%s", err)
        print(f"saopd-train: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(_format_summary(summary))
    return summary


def _run_tags(conf: TrainConfig | DictConfig) -> dict[str, str]:
    """MLflow tags of a run: experiment, filter, objective, seed, sweep, study, method, extras.

    Takes the validated config or, for a job that failed before validation, the raw one.
    """
    named = {k: getattr(conf, k, None) for k in ("study", "method")}
    tags = {"experiment": conf.experiment_name, "filter": conf.filter["name"],
            "objective": conf.objective["name"], "seed": conf.seed, **sweep_tags(),
            **{k: v for k, v in named.items() if v}, **(conf.logger.tags or {})}
    return {k: str(v) for k, v in tags.items()}


def _record_resume_changes(out_dir: Path, changes: dict[str, tuple[str, str]]) -> None:
    """Append the keys a resume changed on purpose (``resume_changes``) to the run's record."""
    record = out_dir / "saopd_resume_changes.jsonl"
    with record.open("a") as fh:
        fh.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                             "changes": {k: {"run": a, "now": b}
                                         for k, (a, b) in changes.items()}}) + "\n")
    log.warning("resume changes %s on purpose (recorded in %s)", ", ".join(changes), record)


def _record_stopped_job(cfg: DictConfig) -> None:
    """Mark a job stopped by SIGTERM as KILLED in MLflow (its run record names the run)."""
    record = Path(str(cfg.paths.output_dir)) / RUN_RECORD
    if cfg.logger.kind != "mlflow" or not record.is_file():
        return
    try:
        import mlflow

        info = json.loads(record.read_text())
        mlflow.MlflowClient(info["tracking_uri"]).set_terminated(info["run_id"], status="KILLED")
    except Exception as mlflow_err:  # the checkpoint is saved; the status is cosmetic
        log.warning("could not mark the stopped run KILLED in MLflow: %s", mlflow_err)


def _record_failed_job(cfg: DictConfig, err: Exception) -> None:
    """A failed sweep job: log it, write FAILED.json, and mark (or make) its MLflow run FAILED."""
    log.error("sweep job failed: %s: %s", type(err).__name__, err,
              exc_info=not isinstance(err, UserError))
    job_dir = Path(str(cfg.paths.output_dir))
    info = record_job_failure(job_dir, err)
    if cfg.logger.kind != "mlflow":
        return
    try:
        import mlflow

        record = job_dir / RUN_RECORD
        previous = json.loads(record.read_text()) if record.is_file() else {}
        uri = (previous.get("tracking_uri") or cfg.logger.tracking_uri
               or default_tracking_uri(str(cfg.paths.root)))
        with store_lock(uri):
            client = mlflow.MlflowClient(uri)
            run_id = previous.get("run_id")
            if run_id is None:  # failed before training made a run: make one, so that every
                name = cfg.logger.experiment_name or cfg.experiment_name  # job is in MLflow
                exp_id = get_or_create_experiment(client, name)
                run_id = client.create_run(exp_id, tags=_run_tags(cfg)).info.run_id
            client.set_tag(run_id, "error", info["error"][:5000])
            client.set_terminated(run_id, status="FAILED")
    except Exception as mlflow_err:  # the failure is already in FAILED.json and the log
        log.warning("could not record the failed job in MLflow: %s", mlflow_err)


def _format_summary(summary: dict[str, Any]) -> str:
    m = summary["metrics"]
    lines = [
        f"saopd-train: {summary['steps']} steps in {summary['seconds']} s",
        f"  outputs:     {summary['output_dir']}",
        f"  checkpoint:  {summary['last_checkpoint']}",
    ]
    if "run_id" in summary:
        lines += [
            f"  MLflow:      {summary['tracking_uri']} (experiment "
            f"'{summary['mlflow_experiment']}', run {summary['run_id']})",
            f"  browse:      mlflow ui --backend-store-uri {summary['tracking_uri']} "
            "--host 127.0.0.1",
        ]
    shown = ("train/loss", "train/flmr", "train/filtered_ratio", "train/kl",
             "train/response_length", "train/step_time")
    lines.append("  last step:   " + ", ".join(
        f"{k.split('/')[-1]}={m[k]:.4g}" for k in shown if k in m))
    lines += _format_evals(summary.get("eval", {}))
    return "\n".join(lines)


def _format_evals(evals: dict[str, dict[str, float]]) -> list[str]:
    """``held-out`` lines: each metric of the first and the last evaluation of the run (by step
    index; -1 = before the first step), e.g. ``arith/avg_at_4: 0.3825 -> 0.4788``."""
    if not evals:
        return []
    steps = sorted(evals, key=int)
    first, last = steps[0], steps[-1]

    def when(step: str) -> str:
        return "before training" if int(step) < 0 else f"after step {int(step) + 1}"

    if first == last:
        head = f"  held-out ({when(last)}):"
        return [head] + [f"    {k.removeprefix('eval/')} = {v:.4g}"
                         for k, v in evals[last].items()]
    lines = [f"  held-out ({when(first)} -> {when(last)}):"]
    for key, value in evals[last].items():
        before = evals[first].get(key)
        shown = "-" if before is None else f"{before:.4g}"
        lines.append(f"    {key.removeprefix('eval/')}: {shown} -> {value:.4g}")
    return lines


if __name__ == "__main__":
    main()

