"""Callbacks: rollouts before every step, the filtered-token view every N steps, held-out
evaluations, and the run's progress as log lines."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar

from saopd.analysis.token_records import (
    StepView,
    prompt_text,
    record_path,
    save_step_record,
    step_record_from_view,
)
from saopd.analysis.token_view import render_token_view, token_rows_from_batch
from saopd.config.rollout import HFRolloutConfig
from saopd.config.train import TrainConfig
from saopd.eval.benchmarks import BENCHMARKS
from saopd.eval.runner import evaluate_benchmark, load_benchmark
from saopd.io import write_jsonl_atomic
from saopd.lightning.data import StepBatch
from saopd.rollout.base import RolloutEngine, SamplingParams
from saopd.rollout.registry import build_engine

#: The logger of the progress lines (:class:`ProgressLines`): on the console and in the run's log.
progress_log = logging.getLogger("saopd.progress")


class RolloutCallback(L.Callback):
    """Samples this step's responses from the current student before ``training_step`` and
    attaches them to the step's :class:`~saopd.lightning.data.StepBatch`.

    Generation runs in eval mode under ``no_grad`` (the engine's job); with a seed, step k
    samples with ``seed + k`` so a resumed run draws exactly what an uninterrupted one would.
    Engines that hold their own weights (vLLM) get the student's weights after every step.

    ``async_steps=1`` (``rollout.async_steps``; engines with their own weights only): step k+1's
    rollouts are sampled in a background thread while step k trains, from the weights the
    engine holds then (one optimizer step old), with the seed step k+1 would use; the engine's
    sync after step k waits for that sampling to end. The first step (and the first step after
    a resume) samples synchronously. ``train/rollout_staleness`` logs how many optimizer steps
    old the sampling weights were (0 or 1); the truncated importance ratio of the sampled
    objectives corrects the mismatch.
    """

    def __init__(self, engine: RolloutEngine, sampling: SamplingParams,
                 sync_weights: bool = False, async_steps: int = 0) -> None:
        if async_steps not in (0, 1):
            raise ValueError(f"async_steps must be 0 or 1, got {async_steps!r}")
        if async_steps and not sync_weights:
            raise ValueError("async_steps=1 needs an engine with its own copy of the weights "
                             "(rollout=vllm or vllm_server): HF generate samples from the very "
                             "module being trained")
        self.engine = engine
        self.sampling = sampling
        self.sync_weights = sync_weights
        self.async_steps = async_steps
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="saopd-rollout") \
            if async_steps else None
        self._ahead: tuple[int, list[Any], Future[Any]] | None = None

    def _sampling(self, trainer: L.Trainer, step: int) -> SamplingParams:
        if self.sampling.seed is None:
            return self.sampling
        # each data-parallel rank draws its own stream (rank 0 as a single process does)
        seed = self.sampling.seed + step + 1_000_003 * trainer.global_rank
        return dataclasses.replace(self.sampling, seed=seed)

    def _take_ahead(self, step: int, messages: list[Any]) -> Any | None:
        """The rollouts sampled ahead for ``step`` if they are for these prompts, else None
        (after waiting for any sampling still running)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        rollouts = ahead[2].result()
        return rollouts if ahead[0] == step and ahead[1] == messages else None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: StepBatch,
                             batch_idx: int) -> None:
        started = time.perf_counter()
        step = trainer.global_step
        rollouts = self._take_ahead(step, batch.messages)
        staleness = 0 if rollouts is None else 1
        if rollouts is None:
            rollouts = self.engine.generate(batch.messages, self._sampling(trainer, step))
        batch.attach_rollouts(rollouts, started=started)
        if self.async_steps:
            pl_module.log("train/rollout_staleness", float(staleness), on_step=True,
                          on_epoch=False, batch_size=1)
            datamodule = getattr(trainer, "datamodule", None)
            if step + 1 < trainer.max_steps and hasattr(datamodule, "step_batch"):
                nxt = datamodule.step_batch(step + 1, trainer.global_rank,
                                            trainer.world_size).messages
                assert self._pool is not None
                self._ahead = (step + 1, nxt, self._pool.submit(
                    self.engine.generate, nxt, self._sampling(trainer, step + 1)))

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        # the engine copied the student before a resumed checkpoint was loaded into it
        if self.sync_weights:
            self.engine.load_weights(pl_module.student.named_parameters())

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self.sync_weights:
            if self._ahead is not None:  # the engine cannot reload while it samples
                wait([self._ahead[2]])
            self.engine.load_weights(pl_module.student.named_parameters())

    def teardown(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            wait([ahead[2]])  # never leave the engine sampling behind a finished run
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class TokenViewCallback(L.Callback):
    """Every ``every_n_steps``, renders the step's responses (the
    :class:`~saopd.analysis.token_records.StepView` its ``training_step`` returned) as an HTML
    page and saves them.

    Each response token is coloured by A_full, with its grounding gap in the tooltip, and the
    tokens SA-OPD filtered are outlined (the paper's Appendix E view). Pages are written to
    ``<out_dir>/token_view/step_XXXXXX.html`` (the 0-based step index that its metrics carry in
    MLflow) and logged to MLflow when an MLflow logger is used.

    With ``save_records`` (default), the same step's per-token data (every response of the
    batch, or the first ``record_rows``: ids, token texts, A_full, A_res, filtered, and the
    student entropy when the step computed it) goes to
    ``<out_dir>/token_records/step_XXXXXX.jsonl.gz`` (:mod:`saopd.analysis.token_records`) and to
    MLflow under ``token_records/``, for offline token statistics (the paper's Table 4) and
    entropy plots (Figure 3b). A separate folder keeps ``token_view/`` to one page per step.
    """

    def __init__(self, every_n_steps: int, out_dir: str | Path, max_rows: int = 8, *,
                 save_records: bool = True, record_rows: int | None = None) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.out_dir = Path(out_dir)
        self.max_rows = max_rows
        self.save_records = save_records
        self.record_rows = record_rows

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        view = outputs.get("view") if isinstance(outputs, Mapping) else None
        done = trainer.global_step  # optimizer steps done, this one included
        if not isinstance(view, StepView) or done % self.every_n_steps != 0 \
                or not trainer.is_global_zero:
            return  # data-parallel: rank 0 writes its rows (other ranks would race on the files)
        step = view.step  # the step index its metrics are logged under (0-based)

        tok = pl_module.tokenizer
        prompts = [prompt_text(m) for m in view.messages]
        rows = token_rows_from_batch(tok, prompts, view.response_ids, view.valid,
                                     view.a_full, view.a_res, view.filtered,
                                     max_rows=self.max_rows,
                                     entropy_student=view.entropy_student)
        html = render_token_view(rows, title=f"step {step}: filter "
                                 f"{pl_module.token_filter.name}", stats=view.stats)
        path = self.out_dir / "token_view" / f"step_{step:06d}.html"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(html, encoding="utf-8")
        files = [(path, "token_view")]
        if self.save_records:
            record = step_record_from_view(view, tok,
                                           filter_name=pl_module.token_filter.name,
                                           max_rows=self.record_rows)
            files.append((save_step_record(record, record_path(
                self.out_dir / "token_records", step)), "token_records"))
        from lightning.pytorch.loggers import MLFlowLogger

        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger):
                for local, folder in files:
                    logger.experiment.log_artifact(logger.run_id, str(local), folder)


class EvalCallback(L.Callback):
    """Every ``every_n_steps`` and after the last step, Avg@k of the live student on held-out
    benchmarks; with ``at_start``, also once before the first step.

    Uses the same code as ``saopd-eval`` (:func:`saopd.eval.runner.evaluate_benchmark`: each
    benchmark graded by its record's grader, :data:`saopd.eval.benchmarks.BENCHMARKS`) with an
    HF engine on the live student, built by :func:`saopd.rollout.registry.build_engine` with the
    run's chat-template variables and, for a vision-language student, its processor
    (``pl_module.contexts``). ``problems``: benchmark name -> its problems
    (:func:`saopd.eval.runner.load_benchmark`); ``sampling``: the same for every benchmark;
    ``batch_size``: problems per ``generate`` call; ``sampler``: the engine's token draw
    (``rollout.sampler``: :mod:`saopd.rollout.sampling`). Scores go to the trainer's loggers as
    ``eval/<name>/avg_at_<k>`` (MLflow names allow no "@") at the index of the step just taken
    (0-based, as the ``train/`` metrics), the evaluation before the first step at index -1; the
    per-sample JSONL to ``<out_dir>/eval/step_XXXXXX/`` (``eval/initial/`` before the first
    step). ``results`` keeps every evaluation of this process: step index -> metrics. A resumed
    run does not repeat the evaluation before the first step. ``progress``: the run's progress
    lines, told when each evaluation starts and what it scored (:class:`ProgressLines`).
    """

    def __init__(self, every_n_steps: int, problems: dict[str, list[Any]],
                 sampling: SamplingParams, out_dir: str | Path, *, batch_size: int = 8,
                 grade_workers: int | None = None, at_start: bool = False,
                 sampler: str = "multinomial",
                 progress: ProgressLines | None = None) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        for name in problems:  # an unknown name fails now, not at the first evaluation
            BENCHMARKS.get(name)
        self.every_n_steps = every_n_steps
        self.problems = problems
        self.sampling = sampling
        self.out_dir = Path(out_dir)
        self.batch_size = batch_size
        self.grade_workers = grade_workers
        self.at_start = at_start
        self.sampler = sampler
        self.progress = progress
        self.results: dict[int, dict[str, float]] = {}

    @classmethod
    def from_config(cls, conf: TrainConfig, out_dir: str | Path, *,
                    progress: ProgressLines | None = None) -> EvalCallback:
        """The run's evaluation (``conf.eval``): its benchmarks loaded now (``ValueError`` or
        ``FileNotFoundError`` for a missing or malformed one), sampled with the run's seed."""
        ev = conf.eval
        problems = {name: load_benchmark(name, ev.data_dir, limit=ev.limit)
                    for name in ev.benchmarks}
        sampling = SamplingParams(n=ev.k, temperature=ev.temperature, top_p=ev.top_p,
                                  max_new_tokens=ev.max_new_tokens, seed=conf.seed)
        return cls(ev.every_n_steps, problems, sampling, out_dir, at_start=ev.at_start,
                   batch_size=ev.batch_size, sampler=ev.sampler, progress=progress)

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self.at_start and trainer.global_step == 0:
            self._evaluate(trainer, pl_module, step=-1, folder="initial")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        done = trainer.global_step
        last = trainer.max_steps is not None and done == trainer.max_steps
        if done % self.every_n_steps == 0 or last:
            self._evaluate(trainer, pl_module, step=done - 1, folder=f"step_{done - 1:06d}")

    def _evaluate(self, trainer: L.Trainer, pl_module: Any, *, step: int, folder: str) -> None:
        started = time.perf_counter()
        if self.progress is not None:
            self.progress.evaluating(step, {name: len(p) for name, p in self.problems.items()},
                                     self.sampling.n)
        contexts = pl_module.contexts
        # HF generate on the module being trained, even when training samples with vLLM: there
        # are no weights to sync, and the engine lives only for this evaluation
        engine = build_engine(HFRolloutConfig(batch_size=self.batch_size, sampler=self.sampler),
                              pl_module.student,
                              pl_module.tokenizer,
                              chat_template_kwargs=contexts.chat_template_kwargs,
                              processor=contexts.processor)
        metrics = {}
        for name, problems in self.problems.items():
            res = evaluate_benchmark(name, problems, engine, pl_module.tokenizer, self.sampling,
                                     batch_size=self.batch_size,
                                     grade_workers=self.grade_workers)
            write_jsonl_atomic(self.out_dir / "eval" / folder / f"{name}.jsonl", res.samples)
            metrics[f"eval/{name}/avg_at_{res.k}"] = res.score
            metrics.update({f"eval/{name}/{key}": v for key, v in res.extra.items()})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        self.results[step] = metrics
        if self.progress is not None:
            self.progress.evaluated(step, metrics, time.perf_counter() - started)


def clock_time(seconds: float) -> str:
    """``seconds`` as ``M:SS`` or ``H:MM:SS`` (``75.4`` -> ``1:15``)."""
    minutes, secs = divmod(round(max(seconds, 0.0)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ProgressLines(ProgressBar):
    """The run's progress bar as log lines (logger ``saopd.progress``: the console and the run's
    log file), readable in a terminal, a CI log or a piped ``make run`` alike, where a redrawn bar
    is not. Written on the global-zero rank only.

    A line after the first step, the last one, and any step that ends ``every_s`` seconds or
    more after the previous line (0: every step)::

        step 40/200 | loss -0.2874 | kl 0.1403 | flmr 0.05 | 2.64 s/step | 1:49 elapsed, ~7:02 left

    with the last step's logged ``train/`` metrics that the run has (loss, KL, the filter's FLMR
    and filtered ratio), the wall seconds per step since the previous line and the training time
    left at the run's mean step (evaluations excluded: each has its own line, from
    :meth:`evaluated`). A step or an evaluation that runs ``still_s`` seconds (30) after the
    last line gets a line of its own, every ``still_s`` seconds it goes on
    (``step 5/200 still running (0:30 since the last line)``), so that a slow run and a hung one
    do not look the same (None: no such lines). ``clock``: the time source (seconds)."""

    #: ``train/`` metrics shown, with their names in the line.
    SHOWN = (("train/loss", "loss"), ("train/kl", "kl"), ("train/flmr", "flmr"),
             ("train/filtered_ratio", "filtered"))

    def __init__(self, every_s: float = 10.0, *, still_s: float | None = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        if not every_s >= 0:
            raise ValueError(f"every_s must be >= 0 seconds, got {every_s!r}")
        if still_s is not None and not still_s > 0:
            raise ValueError(f"still_s must be > 0 seconds or None, got {still_s!r}")
        self.every_s = float(every_s)
        self.still_s = still_s
        self.clock = clock
        self._doing = "training"  # what runs now: the step or the evaluation
        self._stop: threading.Event | None = None  # the watch over long silences, while training
        self.enabled = True
        self._first = 0  # the global step training starts from (0, or a resumed run's)
        self._started = self._last_line = clock()
        self._eval_s = 0.0  # seconds spent evaluating since training started
        self._mark = (0, 0.0)  # the step and the training seconds of the last step line

    def disable(self) -> None:
        """No lines (Lightning disables the bar on ranks other than global zero)."""
        self.enabled = False

    def enable(self) -> None:
        """Lines again."""
        self.enabled = True

    def write(self, line: str) -> None:
        """One line of progress (when enabled); the interval restarts from it."""
        if self.enabled:
            progress_log.info("%s", line)
            self._last_line = self.clock()

    def _watch(self, stop: threading.Event) -> None:
        """Until ``stop``: a line when nothing was written for ``still_s`` seconds."""
        assert self.still_s is not None
        while not stop.wait(min(1.0, self.still_s / 4)):
            quiet = self.clock() - self._last_line
            if quiet >= self.still_s:
                self.write(f"{self._doing} still running ({clock_time(quiet)} since the last "
                           "line)")

    def _end_watch(self) -> None:
        stop, self._stop = self._stop, None
        if stop is not None:
            stop.set()

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self.enabled and self.still_s is not None and self._stop is None:
            self._stop = threading.Event()
            threading.Thread(target=self._watch, args=(self._stop,), daemon=True,
                             name="saopd-progress").start()
        self._first = trainer.global_step
        self._started = self._last_line = self.clock()
        self._eval_s = 0.0
        self._mark = (self._first, 0.0)
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        if total is not None:
            start = f" from step {self._first}" if self._first else ""
            self.write(f"training {total - self._first} steps{start}")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        step = trainer.global_step + 1
        self._doing = f"step {step}/{total}" if total else f"step {step}"

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self._end_watch()

    def on_exception(self, trainer: L.Trainer, pl_module: Any, exception: BaseException
                     ) -> None:
        self._end_watch()  # Lightning calls no ``teardown`` hook when training raised

    def teardown(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
        self._end_watch()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if not self.enabled:
            return
        now, step = self.clock(), trainer.global_step
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        if not (step == self._first + 1 or step == total
                or now - self._last_line >= self.every_s):
            return
        trained = now - self._started - self._eval_s
        mark_step, mark_s = self._mark
        self._mark = (step, trained)
        metrics = trainer.callback_metrics
        parts = [f"step {step}/{total}" if total else f"step {step}"]
        parts += [f"{name} {float(metrics[key]):.4g}" for key, name in self.SHOWN
                  if key in metrics]
        parts.append(f"{(trained - mark_s) / max(step - mark_step, 1):.3g} s/step")
        when = f"{clock_time(now - self._started)} elapsed"
        if total and step < total:
            mean = trained / max(step - self._first, 1)
            when += f", ~{clock_time(mean * (total - step))} left"
        self.write(" | ".join([*parts, when]))

    @staticmethod
    def _eval_name(step: int) -> str:
        return "eval before training" if step < 0 else f"eval after step {step + 1}"

    def evaluating(self, step: int, problems: dict[str, int], k: int) -> None:
        """:class:`EvalCallback` starts an evaluation after the 0-based step index ``step``
        (-1: before the first step) of ``problems`` (benchmark -> problems), ``k`` samples each:
        what a long one's ``still running`` line names."""
        sizes = ", ".join(f"{name} {n} x {k}" for name, n in problems.items())
        self._doing = f"{self._eval_name(step)} ({sizes} samples)"

    def evaluated(self, step: int, metrics: dict[str, float], seconds: float) -> None:
        """An evaluation's line (from :class:`EvalCallback`): when, its wall time and its scores,
        e.g. ``eval after step 25 (21.4 s) | arith/avg_at_4 0.4625 | ...``; ``step`` as in
        :meth:`evaluating`."""
        self._eval_s += seconds
        self._doing = "training"
        scores = [f"{key.removeprefix('eval/')} {value:.4g}" for key, value in metrics.items()]
        self.write(" | ".join([f"{self._eval_name(step)} ({seconds:.1f} s)", *scores]))
