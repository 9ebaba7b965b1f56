"""The LightningModule: one OPD / SA-OPD training step, as in the paper's Algorithm 1.

``training_step`` takes the rollouts the :class:`~saopd.lightning.callbacks.RolloutCallback`
sampled for this step's prompts and then reads like the algorithm::

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

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning as L
import torch

from saopd._checks import check_choice, check_positive
from saopd.data.contexts import TRUNCATION_MODES, PairedContextBatch, collate_contexts
from saopd.filters import FilterResult, TokenFilter
from saopd.filters.distributed import batch_global_filter
from saopd.lightning.metrics import TrainMetrics
from saopd.lightning.sharding import (
    all_reduce_sum,
    dp_world_size,
    enable_activation_checkpointing,
    no_backward_sync,
    shard_model,
)
from saopd.objectives import AGGREGATIONS, Objective, aggregate
from saopd.rollout.base import RolloutBatch
from saopd.signals import LMHead, Logits, TokenSignals
from saopd.training.scoring import FrozenScores, ScoringNeeds, score_frozen, score_student

if TYPE_CHECKING:
    from collections.abc import Mapping

    from torch import nn
    from transformers import PreTrainedTokenizerBase

    from saopd.data.vision import VisionContexts

FROZEN_PREFIXES = ("teacher.", "reference.")
SCHEDULES = ("constant", "linear", "cosine")


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule.

    Attributes:
        lr: peak learning rate (paper: 1e-6).
        weight_decay: AdamW weight decay.
        beta1, beta2, eps: AdamW moments.
        warmup_steps: linear warm-up from 0 to ``lr``.
        schedule: after warm-up, ``constant``, ``linear`` or ``cosine`` decay to
            ``min_lr_ratio * lr`` at the last step.
        min_lr_ratio: floor of the decay as a fraction of ``lr``.
        grad_clip: clip the global gradient norm to this value (None = no clipping).
    """

    lr: float = 1e-6
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "constant"
    min_lr_ratio: float = 0.0
    grad_clip: float | None = 1.0

    def __post_init__(self) -> None:
        check_positive("lr", self.lr, owner="optim")
        check_positive("weight_decay", self.weight_decay, owner="optim", allow_zero=True)
        check_positive("eps", self.eps, owner="optim")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"optim.{name} must be in [0, 1), got {value!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        check_choice("schedule", self.schedule, SCHEDULES, owner="optim")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.grad_clip is not None:
            check_positive("grad_clip", self.grad_clip, owner="optim")

    def lr_factor(self, step: int, total_steps: int) -> float:
        """Multiplier of ``lr`` at optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        span = max(1, total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        decay = 1.0 - progress if self.schedule == "linear" else 0.5 * (1 + math.cos(math.pi *
                                                                                    progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay


@dataclass
class StepConfig:
    """How one training step builds contexts and reduces the loss.

    Attributes:
        aggregation: ``token-mean`` (Eq. 19), ``seq-mean-token-mean`` or ``token-sum``.
        micro_batch_size: rollouts per forward/backward of the student (None = all at once);
            the filter always sees the whole step's batch.
        chunk_size: positions per chunk of the log-prob computation (None = ~256 MiB blocks).
        residual: residual context: ``empty_user`` | ``response_only`` | ``neutral_prompt``.
        keep_system: keep the user's system prompt in the residual context.
        neutral_prompt: the instruction of the ``neutral_prompt`` residual.
        max_length: longest context in tokens (prompt + response); None = no limit.
        truncation: prompts that do not fit: ``left`` (cut the prompt's start, counted) or
            ``error``.
        seed: seed of the step-level randomness (the random filter), combined with the step.
        log_entropy: compute the student's entropy H_S at every response token even when the
            filter and objective do not need it, to log the mean entropy of filtered vs kept
            tokens (``train/entropy_student_filtered`` / ``_kept``; the paper's Figure 3b) and
            keep it in the token records. Costs one extra pass over each logit chunk.
    """

    aggregation: str = "token-mean"
    micro_batch_size: int | None = None
    chunk_size: int | None = None
    residual: str = "empty_user"
    keep_system: bool = False
    neutral_prompt: str = "Please answer the question."
    max_length: int | None = None
    truncation: str = "left"
    seed: int = 0
    log_entropy: bool = False

    def __post_init__(self) -> None:
        check_choice("aggregation", self.aggregation, AGGREGATIONS, owner="step")
        check_choice("residual", self.residual, ("empty_user", "response_only",
                                                 "neutral_prompt"), owner="step")
        check_choice("truncation", self.truncation, TRUNCATION_MODES, owner="step")
        for name in ("micro_batch_size", "chunk_size", "max_length"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"step.{name} must be null or an int >= 1, got {value!r}")


def _rows(t: Any, rows: slice) -> Any:
    return t[rows] if isinstance(t, torch.Tensor) else t


def _slice_batch(batch: PairedContextBatch, rows: slice) -> PairedContextBatch:
    def ctx(c: Any) -> Any:
        return type(c)(**{k: getattr(c, k)[rows] for k in c.__dataclass_fields__})

    return PairedContextBatch(full=ctx(batch.full), residual=ctx(batch.residual),
                              response_ids=batch.response_ids[rows],
                              response_mask=batch.response_mask[rows],
                              truncated_rows=(), padding_side=batch.padding_side)


def _slice_frozen(frozen: FrozenScores, rows: slice) -> FrozenScores:
    head = frozen.teacher_head
    if isinstance(head, LMHead):
        head = dataclasses.replace(head, hidden=head.hidden[rows])
    elif isinstance(head, Logits):
        head = Logits(head.logits[rows])
    return FrozenScores(
        lp_teacher=frozen.lp_teacher[rows], entropy_teacher=_rows(frozen.entropy_teacher, rows),
        lp_teacher_res=_rows(frozen.lp_teacher_res, rows),
        lp_student_res=_rows(frozen.lp_student_res, rows), lp_ref=_rows(frozen.lp_ref, rows),
        teacher_head=head,
    )


def _slice_result(result: FilterResult, rows: slice) -> FilterResult:
    return FilterResult(keep=result.keep[rows], filtered=result.filtered[rows],
                        weights=result.weights[rows], stats=result.stats)


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
        vision_contexts: for a vision-language pair, how contexts are built
            (:class:`saopd.data.vision.VisionContexts`: the student's processor, the residual
            mode ``all`` / ``image`` / ``text``); None for text models.
        chat_template_kwargs: passed to the chat template when contexts are rendered (text
            models; a VLM's are in its ``vision_contexts``), e.g. ``enable_thinking: false``.

    Data parallelism (DDP, FSDP): each rank holds its share of the step's rollouts; the filter
    runs on the gathered global batch (:func:`~saopd.filters.distributed.batch_global_filter`)
    and the loss is normalised by global counts, so W ranks take exactly the step one process
    takes on the concatenated batch.
    """

    def __init__(self, *, student: nn.Module, teacher: nn.Module,
                 tokenizer: PreTrainedTokenizerBase, token_filter: TokenFilter,
                 objective: Objective, reference: nn.Module | None = None,
                 optim: OptimConfig | None = None, step: StepConfig | None = None,
                 total_steps: int = 1, vocab_size: int | None = None,
                 activation_checkpointing: bool = False,
                 fsdp_mixed_precision: str | None = None,
                 vision_contexts: VisionContexts | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.strict_loading = False  # checkpoints hold the student only (see on_save_checkpoint)
        self.student = student
        self.teacher = teacher
        self.reference = reference
        for frozen in (teacher, reference):
            if frozen is not None:
                frozen.eval()
                frozen.requires_grad_(False)
        self.tokenizer = tokenizer
        self.token_filter = token_filter
        self.objective = objective
        self.optim_cfg = optim or OptimConfig()
        self.step_cfg = step or StepConfig()
        self.total_steps = total_steps
        self.vocab_size = vocab_size
        self.activation_checkpointing = activation_checkpointing
        self.fsdp_mixed_precision = fsdp_mixed_precision
        # VLMs: contexts with images expanded and pixel values (saopd.data.vision); text models:
        # collate_contexts with the chat template kwargs the rollout engine rendered with
        self.vision_contexts = vision_contexts
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        extra = ("entropy_student",) if self.step_cfg.log_entropy else ()
        self.needs = ScoringNeeds.from_fields(token_filter.needs, objective.needs, extra)
        self.metrics = TrainMetrics()
        self.pending_rollouts: RolloutBatch | None = None
        self.step_started: float | None = None
        self.last_view: dict[str, Any] | None = None  # for the filtered-token view callback

    # ---- Lightning plumbing ---------------------------------------------------------------
    def configure_model(self) -> None:
        """Activation checkpointing; under ``ModelParallelStrategy`` FSDP2-shard each model.

        Student, teacher and reference are sharded separately (one ``fully_shard`` per decoder
        layer and per root), the frozen ones resharded after every forward.
        """
        if getattr(self, "_configured", False):
            return
        self._configured = True
        if self.activation_checkpointing:
            enable_activation_checkpointing(self.student)
        mesh = self._device_mesh
        if mesh is None:
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

    def configure_optimizers(self) -> Any:
        cfg = self.optim_cfg
        params = [p for p in self.student.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                weight_decay=cfg.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: cfg.lr_factor(s, self.total_steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

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
        cfg = self.step_cfg
        if self.vision_contexts is not None:  # images expanded; pixel values in model_inputs
            return self.vision_contexts.collate(rollouts, cfg).to(self.device)
        return collate_contexts(
            self.tokenizer, rollouts.row_messages(), [r.response_ids for r in rollouts.rollouts],
            residual=cfg.residual, keep_system=cfg.keep_system, neutral_prompt=cfg.neutral_prompt,
            max_length=cfg.max_length, truncation=cfg.truncation,
            prompt_ids=[r.prompt_ids for r in rollouts.rollouts],
            chat_template_kwargs=self.chat_template_kwargs,
        ).to(self.device)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        rollouts = self.pending_rollouts
        if rollouts is None:
            raise RuntimeError("no rollouts for this step: the RolloutCallback must be installed")
        self.pending_rollouts = None
        if not rollouts.rollouts:
            raise RuntimeError("the rollout engine returned no responses for this batch")
        started = self.step_started or time.perf_counter()

        ctx = self.build_contexts(rollouts)
        n_rows, length = ctx.response_ids.shape
        lp_sampler = rollouts.sampler_logprobs(length)
        lp_sampler = None if lp_sampler is None else lp_sampler.to(self.device)
        kw = {"vocab_size": self.vocab_size, "chunk_size": self.step_cfg.chunk_size}
        frozen = score_frozen(ctx, student=self.student, teacher=self.teacher,
                              reference=self.reference, needs=self.needs, **kw)
        generator = torch.Generator(device="cpu").manual_seed(
            self.step_cfg.seed * 1_000_003 + self.global_step)

        opt = self.optimizers()
        opt.zero_grad(set_to_none=True)
        micro = self.step_cfg.micro_batch_size
        mode = self.step_cfg.aggregation
        world = dp_world_size()
        whole = micro is None or micro >= n_rows
        # The filter is batch-global (over every rank's rollouts): score first, filter, then
        # back-propagate with the global counts. With one micro-batch and one rank the first
        # scoring pass carries the gradient itself.
        with torch.set_grad_enabled(whole):
            signals = score_student(ctx, frozen, student=self.student, needs=self.needs,
                                    lp_sampler=lp_sampler, **kw)
        result = batch_global_filter(self.token_filter, signals, generator=generator)
        out = self.objective(signals, result)  # metrics of this rank's rows
        counts = all_reduce_sum(torch.stack([result.keep.sum(), (result.keep.sum(-1) > 0).sum()]))
        num_tokens, num_seqs = counts[0], counts[1]
        if whole:
            # gradients are averaged over the W ranks: back-propagate W x this rank's share
            loss = aggregate(out.loss, result.keep, mode, num_tokens=num_tokens,
                             num_sequences=num_seqs)
            self.manual_backward(loss * world if world > 1 else loss)
        else:
            loss = torch.zeros((), device=self.device)
            starts = list(range(0, n_rows, micro))
            for start in starts:
                rows = slice(start, start + micro)
                sub = score_student(_slice_batch(ctx, rows), _slice_frozen(frozen, rows),
                                    student=self.student, needs=self.needs,
                                    lp_sampler=_rows(lp_sampler, rows), **kw)
                part = _slice_result(result, rows)
                sub_loss = aggregate(self.objective(sub, part).loss, part.keep, mode,
                                     num_tokens=num_tokens, num_sequences=num_seqs)
                with no_backward_sync(self.trainer.strategy, start != starts[-1]):
                    self.manual_backward(sub_loss * world if world > 1 else sub_loss)
                loss = loss + sub_loss.detach()
        loss = all_reduce_sum(loss.detach())  # the global batch's loss

        if self.optim_cfg.grad_clip is not None:
            self.clip_gradients(opt, gradient_clip_val=self.optim_cfg.grad_clip,
                                gradient_clip_algorithm="norm")
        opt.step()
        scheduler = self.lr_schedulers()
        lr_used = scheduler.get_last_lr()[0]  # the rate of this step, before the schedule moves
        scheduler.step()

        self._log_step(loss, signals, result, out.metrics, rollouts, ctx, started, lr_used)
        self._keep_view(rollouts, ctx, signals, result)
        return loss.detach()

    # ---- logging ------------------------------------------------------------------------------
    def _log_step(self, loss: torch.Tensor, signals: TokenSignals, result: FilterResult,
                  objective_metrics: dict[str, torch.Tensor], rollouts: RolloutBatch,
                  ctx: PairedContextBatch, started: float, lr: float) -> None:
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
        values["step_time"] = m.step("step_time", time.perf_counter() - started)
        bar = {"loss", "flmr"}
        # loss and the filter's statistics are already global; the rest are averaged over ranks
        sync = dp_world_size() > 1
        for name, value in values.items():
            self.log(f"train/{name}", value, on_step=True, on_epoch=False,
                     prog_bar=name in bar, batch_size=len(rollouts.rollouts), sync_dist=sync)

    def _keep_view(self, rollouts: RolloutBatch, ctx: PairedContextBatch,
                   signals: TokenSignals, result: FilterResult) -> None:
        self.last_view = {
            "step": self.global_step,
            "messages": rollouts.row_messages(),
            "response_ids": ctx.response_ids.detach().cpu(),
            "valid": signals.valid.cpu(),
            "a_full": signals.a_full.cpu(),
            "a_res": signals.a_res.cpu() if signals.has_residual else None,
            "entropy_student": (signals.entropy_student.detach().cpu()
                                if signals.entropy_student is not None else None),
            "filtered": result.filtered.cpu(),
            "stats": dict(result.stats),
        }
