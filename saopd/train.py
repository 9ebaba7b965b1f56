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
import json
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from omegaconf import DictConfig

import saopd.testbeds  # noqa: F401  (registers the planted-prior model wrapper)
from saopd.config import TrainConfig, register_schema, to_train_config
from saopd.contexts import context_builder
from saopd.paths import conf_dir, register_resolvers

log = logging.getLogger("saopd.train")
CONF_DIR = str(conf_dir())
RUN_RECORD = "saopd_run.json"


class UserError(Exception):
    """A problem with the user's configuration or inputs: reported without a traceback."""


def _build_filter_and_objective(conf: TrainConfig) -> tuple[Any, Any]:
    from saopd.filters import build_filter
    from saopd.objectives import build_objective

    out = []
    for group, build in (("filter", build_filter), ("objective", build_objective)):
        params = dict(getattr(conf, group))
        name = params.pop("name")
        try:
            out.append(build(name, **params))
        except ValueError as err:
            raise UserError(f"config group '{group}': {err}") from None
    return out[0], out[1]


def _prepared_records(path: Path, conf: TrainConfig) -> tuple[list[Any], Any]:
    """Rows of the DVC pipeline's schema (``id``, ``messages``, ``answer``, ``source``)."""
    from saopd.prompts.text import PromptRecord, load_jsonl

    rows, report = load_jsonl(path, skip_bad=conf.data.skip_bad)
    records = []
    for i, row in enumerate(rows, start=1):
        if not isinstance(row.get("messages"), list) or "id" not in row:
            raise UserError(f"{path}: row {i} lacks 'id' or a 'messages' list "
                            "(expected the schema of `dvc repro prepare_train`)")
        records.append(PromptRecord(str(row["id"]), row["messages"], row.get("answer"),
                                    str(row.get("source", "prepared"))))
        if conf.data.limit is not None and len(records) >= conf.data.limit:
            break
    return records, report


def _load_prompts(conf: TrainConfig, tokenizer: Any, processor: Any = None
                  ) -> tuple[list[Any], dict[str, int]]:
    from saopd.prompts.text import filter_long_prompts, gsm8k_records

    path = Path(conf.data.path)
    if not path.is_file():
        hint = " (run `make data` / `dvc repro prepare_train`)" if \
            conf.data.source == "prepared" else ""
        hint = " (run `dvc repro prepare_vlm`)" if conf.data.source == "vision" else hint
        raise UserError(f"data.path: no such file {path}{hint}")
    if conf.data.source == "vision":  # prompts with images (issue 7)
        return _vision_prompts(conf, path, processor)
    if conf.data.source == "prepared":
        records, report = _prepared_records(path, conf)
    else:
        records, report = gsm8k_records(path, system_prompt=conf.data.system_prompt,
                                        instruction=conf.data.instruction,
                                        limit=conf.data.limit, skip_bad=conf.data.skip_bad)
    counts = {"prompts_read": len(records), "rows_skipped_bad": report.skipped}
    max_len = conf.data.max_prompt_length
    if max_len is not None and conf.data.long_prompts != "truncate":
        records, n_long = filter_long_prompts(
            records, tokenizer, max_len, mode=conf.data.long_prompts,
            chat_template_kwargs=conf.data.chat_template_kwargs)
        counts["prompts_skipped_long"] = n_long
    if not records:
        raise UserError(f"no training prompts left from {path} (see data.max_prompt_length)")
    return records, counts


def _vision_prompts(conf: TrainConfig, path: Path, processor: Any
                    ) -> tuple[list[Any], dict[str, int]]:
    """Prompts with images (``data.source: vision``), checked row by row; over-long prompts
    (counting their image tokens) are skipped or refused as ``data.long_prompts`` says."""
    from saopd.prompts.vision import filter_long_vision_prompts, vision_records

    if processor is None:
        raise UserError("data.source=vision needs vision-language models (a tiny vision kind or "
                        "model.vision: true for student and teacher)")
    try:
        records, report = vision_records(path, limit=conf.data.limit,
                                         skip_bad=conf.data.skip_bad)
        counts = {"prompts_read": len(records), "rows_skipped_bad": report.skipped}
        max_len = conf.data.max_prompt_length
        if max_len is not None and conf.data.long_prompts != "truncate":
            records, counts["prompts_skipped_long"] = filter_long_vision_prompts(
                records, processor, max_len, mode=conf.data.long_prompts,
                chat_template_kwargs=conf.data.chat_template_kwargs)
    except ValueError as err:
        raise UserError(f"data: {err}") from None
    if not records:
        raise UserError(f"no training prompts left from {path} (see data.max_prompt_length)")
    return records, counts


def _build_vlm_pair(conf: TrainConfig) -> tuple[Any, Any, Any, Any, Any]:
    """Student, its tokenizer, teacher, its tokenizer and the student's processor of a VLM pair;
    the teacher's processor must agree with the student's (``check_same_processor``)."""
    from saopd.models.factory import build_vlm
    from saopd.models.vlm import check_same_processor

    if not (conf.student.is_vision and conf.teacher.is_vision):
        raise ValueError("student and teacher must both be vision-language models or both text "
                         f"models (student vision: {conf.student.is_vision}, teacher vision: "
                         f"{conf.teacher.is_vision})")
    student, processor = build_vlm(conf.student)
    teacher, teacher_processor = build_vlm(conf.teacher)
    check_same_processor(processor, teacher_processor,
                         chat_template_kwargs=conf.data.chat_template_kwargs)
    return student, processor.tokenizer, teacher, teacher_processor.tokenizer, processor


def _find_resume(conf: TrainConfig) -> Path | None:
    if conf.resume in (None, "", "none"):
        return None
    if conf.resume == "auto":
        runs = Path(conf.paths.root) / "outputs" / conf.experiment_name
        found = sorted(runs.glob("*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
        if not found:
            log.info("resume=auto: no checkpoint under %s, starting fresh", runs)
            return None
        return found[-1]
    path = Path(conf.resume)
    if path.is_dir():
        path = path / "checkpoints" / "last.ckpt"
    if not path.is_file():
        raise UserError(f"resume: no checkpoint at {path}")
    return path


# Intentional here: the frozen teacher stays in eval mode; checkpoints hold the weights after
# each step's optimizer update (manual optimization), which is what resuming needs; and the prompt
# loader needs no saved state to resume mid-epoch (a step's batch is a function of the step).
for _pattern in (r".*module\(s\) in eval mode.*", r".*pre-optimization state was saved.*",
                 r".*your dataloader is not resumable.*"):
    warnings.filterwarnings("ignore", message=_pattern)


def train(cfg: DictConfig, extra_callbacks: list[L.Callback] | None = None) -> dict[str, Any]:
    """Run one training job; returns a summary (paths, MLflow run, final metrics).

    ``extra_callbacks`` are added to the Trainer's (profilers, custom logging, fault injection).
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    from saopd.lightning.callbacks import RolloutCallback, TokenViewCallback
    from saopd.lightning.data import PromptDataModule
    from saopd.lightning.module import OPDModule
    from saopd.models import check_same_vocabulary
    from saopd.models.factory import build_model
    from saopd.rollout.base import SamplingParams
    from saopd.rollout.registry import build_engine, holds_weights

    try:
        conf = to_train_config(cfg)
    except ValueError as err:
        raise UserError(str(err)) from None
    L.seed_everything(conf.seed, workers=True, verbose=False)
    token_filter, objective = _build_filter_and_objective(conf)
    ckpt = _find_resume(conf)
    out_dir = ckpt.parent.parent if ckpt is not None else Path(conf.paths.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    processor = None  # the student's processor when the pair is vision-language (issue 7)
    try:
        if conf.student.is_vision or conf.teacher.is_vision:
            student, tokenizer, teacher, teacher_tok, processor = _build_vlm_pair(conf)
        else:
            student, tokenizer = build_model(conf.student)
            teacher, teacher_tok = build_model(conf.teacher)
        vocab = check_same_vocabulary(tokenizer, teacher_tok, student, teacher)
    except (ValueError, OSError) as err:
        raise UserError(f"models: {err}") from None
    log.info("models ready in %.1f s", time.perf_counter() - started)
    reference = None
    if "lp_ref" in objective.needs:
        reference = copy.deepcopy(student)
    records, data_counts = _load_prompts(conf, tokenizer, processor)

    sampling = SamplingParams(n=conf.rollout.n, temperature=conf.rollout.temperature,
                              top_p=conf.rollout.top_p, max_new_tokens=conf.rollout.max_new_tokens,
                              seed=conf.seed)
    try:
        engine = build_engine(
            conf.rollout, student, tokenizer, max_prompt_length=conf.data.max_prompt_length,
            prompt_truncation="truncate" if conf.data.long_prompts == "truncate" else "error",
            seed=conf.seed, devices=conf.trainer.devices, num_nodes=conf.trainer.num_nodes,
            chat_template_kwargs=conf.data.chat_template_kwargs, processor=processor)
    except (ImportError, ValueError) as err:
        raise UserError(f"rollout: {err}") from None
    # from here on the engine is closed whatever happens: an engine with its own copy of the
    # model (vLLM) must free it, since sweeps run their jobs in one process
    try:
        module = OPDModule(student=student, teacher=teacher, tokenizer=tokenizer,
                           token_filter=token_filter, objective=objective, reference=reference,
                           optim=conf.optim, step=conf.step, total_steps=conf.steps,
                           vocab_size=vocab.common_logits,
                           activation_checkpointing=conf.trainer.activation_checkpointing,
                           fsdp_mixed_precision=conf.trainer.fsdp_mixed_precision,
                           contexts=context_builder(
                               tokenizer, processor, residual_remove=conf.data.residual_remove,
                               chat_template_kwargs=conf.data.chat_template_kwargs))
        data = PromptDataModule(records, prompts_per_step=conf.prompts_per_step,
                                num_steps=conf.steps, seed=conf.seed, shuffle=conf.data.shuffle)

        # Under DDP/FSDP every rank runs this function; only global rank 0 tracks the run.
        zero = _global_rank() == 0
        loggers, run_info = (_make_logger(conf, out_dir, resuming=ckpt is not None) if zero
                             else ([], {}))
        callbacks: list[L.Callback] = [
            RolloutCallback(engine, sampling, sync_weights=holds_weights(engine)),
            ModelCheckpoint(dirpath=out_dir / "checkpoints", filename="step_{step:06d}",
                            every_n_train_steps=conf.trainer.checkpoint_every_n_steps,
                            save_last=True,
                            save_top_k=-1 if conf.trainer.keep_all_checkpoints else 1,
                            auto_insert_metric_name=False),
        ]
        if conf.trainer.view_every_n_steps:
            callbacks.append(TokenViewCallback(conf.trainer.view_every_n_steps, out_dir))
        if conf.eval.every_n_steps:
            callbacks.append(_eval_callback(conf, out_dir))
        callbacks.extend(extra_callbacks or [])
        trainer = L.Trainer(
            accelerator=conf.trainer.accelerator, devices=conf.trainer.devices,
            num_nodes=conf.trainer.num_nodes, strategy=_strategy(conf),
            precision=conf.trainer.precision, max_steps=conf.steps, logger=loggers,
            callbacks=callbacks, log_every_n_steps=1, num_sanity_val_steps=0,
            limit_val_batches=0, enable_progress_bar=conf.trainer.progress_bar,
            enable_model_summary=False, default_root_dir=str(out_dir),
            use_distributed_sampler=False,  # PromptDataModule splits each step's batch by rank
        )
        if loggers and ckpt is None:
            from saopd.tracking import log_resolved_config

            log_resolved_config(loggers[0], cfg)
            for name, value in data_counts.items():
                loggers[0].log_metrics({f"data/{name}": float(value)}, step=0)
        trainer.fit(module, datamodule=data, ckpt_path=str(ckpt) if ckpt else None)
    finally:
        close = getattr(engine, "close", None)
        if callable(close):
            close()

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    summary = {"output_dir": str(out_dir), "steps": trainer.global_step, **run_info,
               "last_checkpoint": str(out_dir / "checkpoints" / "last.ckpt"),
               "metrics": metrics, "data": data_counts,
               "seconds": round(time.perf_counter() - started, 1)}
    if trainer.is_global_zero:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _global_rank() -> int:
    """This process's global rank as the launcher set it (0 before any launch)."""
    from lightning.pytorch.utilities import rank_zero_only

    return int(getattr(rank_zero_only, "rank", 0) or 0)


def _world_size(conf: TrainConfig) -> int:
    """Processes over all nodes: ``trainer.devices`` (a count, a list, or -1/"auto") x nodes."""
    devices = conf.trainer.devices
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if devices in (-1, "auto"):
        if conf.trainer.accelerator in ("gpu", "cuda", "auto"):
            import torch

            devices = torch.cuda.device_count()
        else:
            raise UserError("trainer.strategy=fsdp on CPU needs trainer.devices as a number")
    count = len(devices) if isinstance(devices, (list, tuple)) else int(devices)
    if count < 1:
        raise UserError(f"trainer.devices: no devices ({conf.trainer.devices!r})")
    return count * conf.trainer.num_nodes


def _strategy(conf: TrainConfig) -> Any:
    """The Lightning strategy of ``trainer.strategy`` (``ddp``, ``fsdp`` or a Lightning name)."""
    t = conf.trainer
    if t.strategy == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend=t.process_group_backend)
    if t.strategy == "fsdp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        # One file per checkpoint with the student only (see OPDModule.on_save_checkpoint), as
        # in single-process runs, so that resuming and saopd-eval read it the same way.
        return ModelParallelStrategy(data_parallel_size=_world_size(conf), tensor_parallel_size=1,
                                     save_distributed_checkpoint=False,
                                     process_group_backend=t.process_group_backend)
    return t.strategy


def _eval_callback(conf: TrainConfig, out_dir: Path) -> L.Callback:
    from saopd.eval.runner import load_benchmark
    from saopd.lightning.callbacks import EvalCallback
    from saopd.rollout.base import SamplingParams

    try:
        problems = {name: load_benchmark(name, conf.eval.data_dir, limit=conf.eval.limit)
                    for name in conf.eval.benchmarks}
    except (FileNotFoundError, ValueError) as err:
        raise UserError(f"eval: {err}") from None
    sampling = SamplingParams(n=conf.eval.k, temperature=conf.eval.temperature,
                              top_p=conf.eval.top_p, max_new_tokens=conf.eval.max_new_tokens,
                              seed=conf.seed)
    return EvalCallback(conf.eval.every_n_steps, problems, sampling, out_dir)


def _make_logger(conf: TrainConfig, out_dir: Path, *, resuming: bool
                 ) -> tuple[list[Any], dict[str, Any]]:
    if conf.logger.kind == "none":
        return [], {}
    from saopd.tracking import default_tracking_uri, make_mlflow_logger

    record = out_dir / RUN_RECORD
    previous = json.loads(record.read_text()) if resuming and record.is_file() else {}
    uri = conf.logger.tracking_uri or previous.get("tracking_uri") or default_tracking_uri(
        conf.paths.root)
    name = conf.logger.experiment_name or conf.experiment_name
    run_name = conf.logger.run_name or (
        f"{conf.experiment_name}-{conf.filter['name']}-{conf.objective['name']}-s{conf.seed}")
    tags = _run_tags(conf)
    logger = make_mlflow_logger(experiment_name=name, tracking_uri=uri, run_name=run_name,
                                run_id=previous.get("run_id"), tags=tags,
                                root=Path(conf.paths.root))
    info = {"tracking_uri": uri, "mlflow_experiment": name, "run_id": logger.run_id}
    record.write_text(json.dumps(info, indent=2) + "\n")
    return [logger], info


register_schema()
register_resolvers()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def main(cfg: DictConfig) -> dict[str, Any] | None:
    """Hydra entry point (``saopd-train``); returns the run's summary (None if it failed).

    A single run that fails exits with status 2 (configuration) or re-raises. In a sweep
    (``-m``) a failed job is recorded (``FAILED.json``, a FAILED MLflow run) and the sweep goes
    on; :class:`saopd.sweeps.SweepSummary` reports the failures when the sweep ends.
    """
    from saopd.sweeps import is_multirun

    try:
        summary = train(cfg)
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
    from saopd.sweeps import sweep_tags

    named = {k: getattr(conf, k, None) for k in ("study", "method")}
    tags = {"experiment": conf.experiment_name, "filter": conf.filter["name"],
            "objective": conf.objective["name"], "seed": conf.seed, **sweep_tags(),
            **{k: v for k, v in named.items() if v}, **(conf.logger.tags or {})}
    return {k: str(v) for k, v in tags.items()}


def _record_failed_job(cfg: DictConfig, err: Exception) -> None:
    """A failed sweep job: log it, write FAILED.json, and mark (or make) its MLflow run FAILED."""
    from saopd.sweeps import record_job_failure

    log.error("sweep job failed: %s: %s", type(err).__name__, err,
              exc_info=not isinstance(err, UserError))
    job_dir = Path(str(cfg.paths.output_dir))
    info = record_job_failure(job_dir, err)
    if cfg.logger.kind != "mlflow":
        return
    try:
        import mlflow

        from saopd.tracking import default_tracking_uri, store_lock

        record = job_dir / RUN_RECORD
        previous = json.loads(record.read_text()) if record.is_file() else {}
        uri = (previous.get("tracking_uri") or cfg.logger.tracking_uri
               or default_tracking_uri(str(cfg.paths.root)))
        with store_lock(uri):
            client = mlflow.MlflowClient(uri)
            run_id = previous.get("run_id")
            if run_id is None:  # failed before training made a run: make one, so that every
                name = cfg.logger.experiment_name or cfg.experiment_name  # job is in MLflow
                exp = client.get_experiment_by_name(name)
                exp_id = exp.experiment_id if exp else client.create_experiment(name)
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
    return "\n".join(lines)


if __name__ == "__main__":
    main()

