"""The LightningModule: one OPD / SA-OPD training step, as in the paper's Algorithm 1.

``training_step`` takes the rollouts the :class:`~saopd.lightning.callbacks.RolloutCallback`
sampled for this step's prompts (attached to its input, a :class:`~saopd.lightning.data.StepBatch`)
and then reads like the algorithm::

    contexts  <- full (prompt + response) and residual (task input removed + same response)
    frozen    <- teacher full, teacher/student residual, reference   (no grad)
    signals   <- student full (grad) -> TokenSignals (A_full, A_res, grounding gap, ...)
    result    <- filter(signals)                  batch-global: F, FLMR, alpha
    loss      <- aggregate(objective(signals, result), kept tokens)   Eq. 19
    backward, clip, AdamW step, LR schedule

The teacher (and the optional ExOPD reference) are frozen: eval mode, ``requires_grad=False``,
outside the optimizer, and stripped from checkpoints. Residual passes run only when the filter
needs them. Optimisation is manual so that a step's micro-batches (``micro_batch_size``) share
one batch-global filter and one global token count: their gradients add up to exactly the
full-batch gradient.
"""

from __future__ import annotations

import copy
import time
from typing import TYPE_CHECKING, Any, TypedDict

import lightning as L
import torch

from saopd.analysis.token_records import StepView
from saopd.config.step import OptimConfig, StepConfig
from saopd.config.train import TrainConfig
from saopd.contexts import ContextBuilder, TextContexts, context_builder
from saopd.contexts.batch import PairedContextBatch
from saopd.data_parallel import all_reduce_sum, world_size
from saopd.filters import FilterResult, TokenFilter
from saopd.filters.distributed import batch_global_filter
from saopd.lightning.data import StepBatch
from saopd.lightning.metrics import TrainMetrics
from saopd.models.factory import ModelPair
from saopd.models.sharding import (
    enable_activation_checkpointing,
    is_meta,
    materialize_sharded,
    mesh_device,
    no_backward_sync,
    shard_model,
)
from saopd.objectives import Objective, aggregate
from saopd.rollout.base import RolloutBatch
from saopd.scoring.passes import ScoringNeeds, score_frozen, score_student
from saopd.scoring.teacher_service import TeacherScorer
from saopd.signals import TokenSignals

if TYPE_CHECKING:

    from torch import nn
    from transformers import PreTrainedTokenizerBase


FROZEN_PREFIXES = ("teacher.", "reference.")


class StepOutput(TypedDict):
    """What ``training_step`` returns; Lightning gives it to every callback's
    ``on_train_batch_end`` as ``outputs`` (``loss`` detached)."""

    loss: torch.Tensor  # the global batch's loss (scalar)
    view: StepView  # this rank's tokens, signals and filter decisions, on the CPU


class OPDModule(L.LightningModule):
    """Student + frozen teacher (+ frozen reference) trained by on-policy distillation.

    Args:
        student: the trained causal LM.
        teacher: the frozen teacher causal LM (same tokenizer vocabulary).
        tokenizer: shared tokenizer with a chat template.
        token_filter: which tokens carry loss (``saopd.filters``).
        objective: the per-token loss (``saopd.objectives``).
        reference: frozen copy of the initial student, for ExOPD.
        optim: AdamW and schedule; ``total_steps`` for decaying schedules.
        step: context building and loss reduction.
        vocab_size: logits used by both models (their common head width).
        activation_checkpointing: recompute the student's decoder layers in backward.
        fsdp_mixed_precision: ``"bf16"`` or None: FSDP2's compute dtype when the strategy is
            ``ModelParallelStrategy`` (``trainer.strategy=fsdp``); ignored otherwise.
        contexts: how the step's contexts are built (:func:`saopd.contexts.context_builder`:
            text or vision-language, chosen once); None = :class:`~saopd.contexts.TextContexts`
            on ``tokenizer`` with no extra template variables.
        teacher_scorer: a teacher-scoring service (:mod:`saopd.scoring.teacher_service`,
            ``teacher_scoring=vllm|vllm_server``) instead of the teacher module (``teacher``
            None then): the step's teacher contexts are sent as soon as they are built and the
            student's passes run while the teacher scores.

    Data parallelism (DDP, FSDP): each rank holds its share of the step's rollouts; the filter
    runs on the gathered global batch (:func:`~saopd.filters.distributed.batch_global_filter`)
    and the loss is normalised by global counts, so W ranks take exactly the step one process
    takes on the concatenated batch.
    """

    def __init__(self, *, student: nn.Module, teacher: nn.Module | None,
                 tokenizer: PreTrainedTokenizerBase, token_filter: TokenFilter,
                 objective: Objective, reference: nn.Module | None = None,
                 optim: OptimConfig | None = None, step: StepConfig | None = None,
                 total_steps: int = 1, vocab_size: int | None = None,
                 activation_checkpointing: bool = False,
                 fsdp_mixed_precision: str | None = None,
                 contexts: ContextBuilder | None = None,
                 teacher_scorer: TeacherScorer | None = None) -> None:
        super().__init__()
        if (teacher is None) == (teacher_scorer is None):
            raise ValueError("OPDModule needs either the teacher module (teacher_scoring=hf) or "
                             "a teacher-scoring service (teacher_scorer), not both or neither")
        self.automatic_optimization = False
        self.strict_loading = False  # checkpoints hold the student only (see on_save_checkpoint)
        self.student = student
        self.teacher = teacher
        self.teacher_scorer = teacher_scorer
        self.reference = reference
        for frozen in (teacher, reference):
            if frozen is not None:
                frozen.eval()
                frozen.requires_grad_(False)
        self.tokenizer = tokenizer
        self.token_filter = token_filter
        token_filter.bind_tokenizer(tokenizer)
        self.objective = objective
        self.optim_cfg = optim or OptimConfig()
        self.step_cfg = step or StepConfig()
        self.total_steps = total_steps
        self.vocab_size = vocab_size
        self.activation_checkpointing = activation_checkpointing
        self.fsdp_mixed_precision = fsdp_mixed_precision
        self.contexts = contexts if contexts is not None else TextContexts(tokenizer)
        extra = ("entropy_student",) if self.step_cfg.log_entropy else ()
        self.needs = ScoringNeeds.of(token_filter, objective, extra=extra)
        self.metrics = TrainMetrics()

    @classmethod
    def from_config(cls, conf: TrainConfig, pair: ModelPair, token_filter: TokenFilter,
                    objective: Objective, scorer: TeacherScorer | None = None) -> OPDModule:
        """The module of a run: ``pair``'s student and teacher (or ``scorer``, a
        teacher-scoring service, when the pair holds no teacher), a frozen copy of the student
        when the objective needs the reference (ExOPD's ``lp_ref``), ``conf``'s optimizer, step,
        activation checkpointing and FSDP precision, and the pair's context builder
        (:func:`saopd.contexts.context_builder`: the teacher's own template when it scores its
        own contexts, response ids mapped)."""
        return cls(
            student=pair.student, teacher=pair.teacher, teacher_scorer=scorer,
            tokenizer=pair.tokenizer, token_filter=token_filter, objective=objective,
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

    # ---- Lightning plumbing ---------------------------------------------------------------
    def configure_model(self) -> None:
        """Activation checkpointing; under ``ModelParallelStrategy`` FSDP2-shard each model.

        Student, teacher and reference are sharded separately (one ``fully_shard`` per decoder
        layer and per root), the frozen ones resharded after every forward. Models built on the
        meta device (``trainer.strategy=fsdp``: :func:`saopd.models.factory.load_device`) are
        then allocated shard by shard on this rank's device and filled from rank 0's build
        (:func:`~saopd.models.sharding.materialize_sharded`).
        """
        if getattr(self, "_configured", False):
            return
        self._configured = True
        if self.activation_checkpointing:
            enable_activation_checkpointing(self.student)
        models = [m for m in (self.student, self.teacher, self.reference) if m is not None]
        mesh = self._device_mesh
        if mesh is None:
            if any(is_meta(m) for m in models):
                raise ValueError("models built on the meta device need trainer.strategy=fsdp, "
                                 "which fills them after sharding")
            return
        dp_mesh = mesh["data_parallel"]
        if mesh.size() != dp_mesh.size():
            raise ValueError("trainer.strategy=fsdp supports data parallelism only "
                             f"(mesh {mesh.shape}); set tensor_parallel_size to 1")
        shard_model(self.student, dp_mesh, mixed_precision=self.fsdp_mixed_precision)
        for frozen in (self.teacher, self.reference):
            if frozen is not None:
                shard_model(frozen, dp_mesh, mixed_precision=self.fsdp_mixed_precision,
                            frozen=True)
        for model in models:
            if is_meta(model):
                materialize_sharded(model, mesh_device(dp_mesh))

    def configure_optimizers(self) -> Any:
        cfg = self.optim_cfg
        params = [p for p in self.student.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                weight_decay=cfg.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: cfg.lr_factor(s, self.total_steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_start(self) -> None:
        """The optimizer's hyperparameters are the config's, also after a resume: Lightning
        restores the checkpoint's param groups (lr, betas, eps, weight decay) and the schedule's
        base rate, so a resume that changes them on purpose (``resume_changes=[optim.lr]``, or
        ``steps`` for a decaying schedule) would otherwise go on with the old ones. On a fresh
        run this changes nothing."""
        cfg = self.optim_cfg
        opt = self.optimizers(use_pl_optimizer=False)
        scheduler = self.lr_schedulers()
        step = scheduler.last_epoch  # optimizer steps taken (the schedule's position)
        for group in opt.param_groups:
            group.update(lr=cfg.lr * cfg.lr_factor(step, self.total_steps), initial_lr=cfg.lr,
                         betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                         weight_decay=cfg.weight_decay)
        scheduler.base_lrs = [cfg.lr] * len(opt.param_groups)

    def train(self, mode: bool = True) -> OPDModule:
        super().train(mode)
        for frozen in (self.teacher, self.reference):  # frozen models stay in eval mode
            if frozen is not None:
                frozen.eval()
        return self

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["state_dict"]
        for key in [k for k in state if k.startswith(FROZEN_PREFIXES)]:
            del state[key]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["state_dict"]
        expected = {f"student.{k}" for k in self.student.state_dict()}
        missing = sorted(expected - set(state))
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} student tensors, e.g. {missing[:3]}")

    # ---- the step ---------------------------------------------------------------------------
    def build_contexts(self, rollouts: RolloutBatch) -> PairedContextBatch:
        """The step's full and residual contexts (:attr:`contexts`), on this module's device."""
        return self.contexts.collate(
            rollouts.row_messages(), [r.response_ids for r in rollouts.rollouts],
            step=self.step_cfg, prompt_ids=[r.prompt_ids for r in rollouts.rollouts],
        ).to(self.device)

    def training_step(self, batch: StepBatch, batch_idx: int) -> StepOutput:
        """One step on ``batch``'s rollouts (attached by the RolloutCallback); returns the
        global loss and the step's :class:`~saopd.analysis.token_records.StepView`."""
        rollouts = batch.take_rollouts()
        started = batch.started or time.perf_counter()
        index = self.global_step  # this step's 0-based index (the optimizer has not stepped)

        ctx = self.build_contexts(rollouts)
        n_rows, length = ctx.response_ids.shape
        lp_sampler = rollouts.sampler_logprobs(length)
        lp_sampler = None if lp_sampler is None else lp_sampler.to(self.device)
        kw = {"vocab_size": self.vocab_size, "chunk_size": self.step_cfg.chunk_size}
        pending = None
        if self.teacher_scorer is not None:  # in flight while the student's passes run
            pending = self.teacher_scorer.submit(ctx, self.needs,
                                                 messages=rollouts.row_messages())
        frozen = score_frozen(ctx, student=self.student, teacher=self.teacher,
                              reference=self.reference, needs=self.needs,
                              teacher_scores=pending, **kw)
        generator = torch.Generator(device="cpu").manual_seed(
            self.step_cfg.seed * 1_000_003 + index)

        opt = self.optimizers()
        opt.zero_grad(set_to_none=True)
        micro = self.step_cfg.micro_batch_size or n_rows
        world = world_size()
        whole = micro >= n_rows
        # The filter is batch-global (over every rank's rollouts): score first, filter, then
        # back-propagate with the global counts. With one micro-batch the first scoring pass
        # carries the gradient itself; with several, each micro-batch is scored again with it.
        with torch.set_grad_enabled(whole):
            signals = score_student(ctx, frozen, student=self.student, needs=self.needs,
                                    lp_sampler=lp_sampler, **kw)
        result = batch_global_filter(self.token_filter, signals, generator=generator)
        out = self.objective(signals, result)  # metrics of this rank's rows
        counts = all_reduce_sum(torch.stack([result.keep.sum(), (result.keep.sum(-1) > 0).sum()]))
        chunks = [slice(start, start + micro) for start in range(0, n_rows, micro)]
        loss = torch.zeros((), device=self.device)
        for i, rows in enumerate(chunks):
            if whole:
                part, part_loss = result, out.loss
            else:
                part = result.rows(rows)
                sub = score_student(ctx.rows(rows), frozen.rows(rows), student=self.student,
                                    needs=self.needs,
                                    lp_sampler=None if lp_sampler is None else lp_sampler[rows],
                                    **kw)
                part_loss = self.objective(sub, part).loss
            chunk_loss = aggregate(part_loss, part.keep, self.step_cfg.aggregation,
                                   num_tokens=counts[0], num_sequences=counts[1])
            # gradients are averaged over the W ranks: back-propagate W x this rank's share
            with no_backward_sync(self.trainer.strategy, i != len(chunks) - 1):
                self.manual_backward(chunk_loss * world if world > 1 else chunk_loss)
            loss = loss + chunk_loss.detach()
        loss = all_reduce_sum(loss)  # the global batch's loss

        if self.optim_cfg.grad_clip is not None:
            self.clip_gradients(opt, gradient_clip_val=self.optim_cfg.grad_clip,
                                gradient_clip_algorithm="norm")
        lr_used = float(opt.param_groups[0]["lr"])  # the rate this step's update uses
        opt.step()
        self.lr_schedulers().step()

        self._log_step(loss, signals, result, out.metrics, rollouts, ctx, started, lr_used,
                       teacher_wait=frozen.teacher_wait if pending is not None else None)
        return {"loss": loss.detach(),
                "view": self._view(index, rollouts, ctx, signals, result)}

    # ---- logging ------------------------------------------------------------------------------
    def _log_step(self, loss: torch.Tensor, signals: TokenSignals, result: FilterResult,
                  objective_metrics: dict[str, torch.Tensor], rollouts: RolloutBatch,
                  ctx: PairedContextBatch, started: float, lr: float,
                  teacher_wait: float | None = None) -> None:
        m = self.metrics
        lengths = ctx.response_mask.sum(-1).float()
        values: dict[str, torch.Tensor] = {
            "loss": m.step("loss", loss),
            "kl": m.step("kl", objective_metrics["kl_sampled"]),
            "response_length": m.step("response_length", lengths.mean(), len(lengths)),
            "tokens": m.step("tokens", float(signals.num_valid)),
            "truncated_prompts": m.step(
                "truncated_prompts", float(ctx.num_truncated + rollouts.num_truncated_prompts)),
            "unfinished_responses": m.step(
                "unfinished_responses",
                sum(not r.finished for r in rollouts.rollouts) / len(rollouts.rollouts)),
        }
        values.update(m.step_filter_stats(result.stats))
        for key, value in objective_metrics.items():
            if key != "kl_sampled":
                values[key] = value
        values["lr"] = torch.tensor(lr)
        if teacher_wait is not None:  # seconds the step waited for the teacher service
            values["teacher_wait"] = m.step("teacher_wait", teacher_wait)
        values["step_time"] = m.step("step_time", time.perf_counter() - started)
        bar = {"loss", "flmr"}
        # loss and the filter's statistics are already global; the rest are averaged over ranks
        sync = world_size() > 1
        for name, value in values.items():
            self.log(f"train/{name}", value, on_step=True, on_epoch=False,
                     prog_bar=name in bar, batch_size=len(rollouts.rollouts), sync_dist=sync)

    @staticmethod
    def _view(index: int, rollouts: RolloutBatch, ctx: PairedContextBatch,
              signals: TokenSignals, result: FilterResult) -> StepView:
        return StepView(
            step=index,
            messages=rollouts.row_messages(),
            response_ids=ctx.response_ids.detach().cpu(),
            valid=signals.valid.cpu(),
            a_full=signals.a_full.cpu(),
            a_res=signals.a_res.cpu() if signals.has_residual else None,
            entropy_student=(signals.entropy_student.detach().cpu()
                             if signals.entropy_student is not None else None),
            filtered=result.filtered.cpu(),
            stats=dict(result.stats),
        )
