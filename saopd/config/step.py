"""Schema of the optimizer (``optim``) and of one training step (``step``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from saopd.choices import AGGREGATIONS, RESIDUAL_MODES, SCHEDULES, TRUNCATION_MODES
from saopd.validation import check_choice, check_int, check_positive

__all__ = ["DEFAULT_NEUTRAL_PROMPT", "OptimConfig", "StepConfig"]

#: The user turn of the ``neutral_prompt`` residual context (``step.neutral_prompt``).
DEFAULT_NEUTRAL_PROMPT = "Please answer the question."


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
        truncation: prompts that do not fit: ``truncate`` (cut the prompt's start, counted) or
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
    neutral_prompt: str = DEFAULT_NEUTRAL_PROMPT
    max_length: int | None = None
    truncation: str = "truncate"
    seed: int = 0
    log_entropy: bool = False

    def __post_init__(self) -> None:
        check_choice("aggregation", self.aggregation, AGGREGATIONS, owner="step")
        check_choice("residual", self.residual, RESIDUAL_MODES, owner="step")
        check_choice("truncation", self.truncation, TRUNCATION_MODES, owner="step")
        for name in ("micro_batch_size", "chunk_size", "max_length"):
            check_int(name, getattr(self, name), owner="step", allow_none=True)
