"""Prompt batches for training: one batch per optimizer step, resumable at any step.

Step k trains on prompts ``stream[k*B : (k+1)*B]`` of one endless stream that concatenates the
epochs' shuffled orders (epoch e: ``PromptSampler.order(e)``, seeded by ``seed + e``). The batch
of a step is therefore a pure function of (seed, step): a run resumed at step k draws exactly the
prompts an uninterrupted run would, whatever the DataLoader prefetched before the interruption.

With W data-parallel ranks, rank r takes the r-th contiguous W-th of every step's batch, so the
ranks' rows concatenated in rank order are exactly the batch one process would take (which the
batch-global filter and the global loss normalisation rely on).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, Sampler

from saopd.config.train import TrainConfig
from saopd.prompts.text import PromptDataset, PromptRecord, PromptSampler, collate_prompts
from saopd.rollout.base import RolloutBatch


@dataclass
class StepBatch:
    """One optimizer step's input on this rank: its prompts, then the responses sampled for them.

    The dataloader yields it with the prompts only (``ids``, ``messages``: chat messages per
    prompt, ``answers``: reference answers or None). Before ``training_step`` the
    :class:`~saopd.lightning.callbacks.RolloutCallback` fills it through
    :meth:`attach_rollouts`; ``training_step`` takes them with :meth:`take_rollouts`, so the
    step's data reaches the module through its input and nowhere else. It holds no tensors: the
    module moves the step's contexts to its device itself.
    """

    ids: list[str]
    messages: list[list[dict[str, Any]]]
    answers: list[str | None]
    rollouts: RolloutBatch | None = field(default=None, repr=False)
    #: ``time.perf_counter()`` when the step's work began (its sampling included)
    started: float | None = None

    @classmethod
    def of(cls, records: Sequence[PromptRecord]) -> StepBatch:
        """The batch of ``records`` (copies of their messages), rollouts not sampled yet."""
        return cls(**collate_prompts(records))

    def attach_rollouts(self, rollouts: RolloutBatch, *, started: float | None = None) -> None:
        """Give the batch its responses (``rollouts``: sampled for :attr:`messages`, in their
        order); ``started``: when the step's work began. Raises ``ValueError`` when the
        rollouts were sampled for another number of prompts."""
        if len(rollouts.messages) != len(self.messages):
            raise ValueError(f"the rollouts are for {len(rollouts.messages)} prompts, not this "
                             f"step's {len(self.messages)}")
        self.rollouts, self.started = rollouts, started

    def take_rollouts(self) -> RolloutBatch:
        """The attached rollouts; ``RuntimeError`` when none were attached or none came back."""
        if self.rollouts is None:
            raise RuntimeError("no rollouts for this step: the RolloutCallback must be "
                               "installed (it attaches them to the step's batch)")
        if not self.rollouts.rollouts:
            raise RuntimeError("the rollout engine returned no responses for this batch")
        return self.rollouts


class StepBatchSampler(Sampler[list[int]]):
    """Yields the index batches of steps ``start_step, ..., num_steps - 1``.

    ``start_step`` may be a callable, read each time iteration starts: the training loop's
    current step. Lightning re-iterates a loader at every epoch start and, after a mid-epoch
    resume, counts the epoch's batches from where the checkpoint was; reading the step at
    ``iter()`` keeps batch k tied to step k in every case. ``len()`` is ``num_steps``.
    With ``world_size`` W > 1 each step yields rank ``rank``'s contiguous ``batch_size / W``
    share of the global batch (``batch_size`` must be divisible by W).
    """

    def __init__(self, num_prompts: int, batch_size: int, num_steps: int, *, seed: int = 0,
                 shuffle: bool = True, start_step: int | Callable[[], int] = 0,
                 rank: int = 0, world_size: int = 1) -> None:
        if batch_size < 1 or num_steps < 1:
            raise ValueError(f"batch_size and num_steps must be >= 1, got {batch_size}, "
                             f"{num_steps}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank {rank}, "
                             f"world_size {world_size}")
        if batch_size % world_size:
            raise ValueError(
                f"prompts_per_step ({batch_size}) must be divisible by the number of "
                f"data-parallel ranks ({world_size}): every rank takes an equal share")
        self.rank, self.world_size = rank, world_size
        self.order = PromptSampler(num_prompts, seed=seed, shuffle=shuffle)
        self.num_prompts, self.batch_size, self.num_steps = num_prompts, batch_size, num_steps
        self.start_step = start_step

    def batch(self, step: int) -> list[int]:
        """Prompt indices of optimizer step ``step``."""
        first = step * self.batch_size
        out: list[int] = []
        epoch, pos = divmod(first, self.num_prompts)
        while len(out) < self.batch_size:
            order = self.order.order(epoch)
            take = order[pos: pos + self.batch_size - len(out)]
            out.extend(take)
            epoch, pos = epoch + 1, 0
        return out

    def __iter__(self) -> Iterator[list[int]]:
        start = self.start_step() if callable(self.start_step) else self.start_step
        share = self.batch_size // self.world_size
        for step in range(start, self.num_steps):
            yield self.batch(step)[self.rank * share: (self.rank + 1) * share]

    def __len__(self) -> int:
        return self.num_steps


class PromptDataModule(L.LightningDataModule):
    """Serves ``prompts_per_step`` prompts per training step from a list of records."""

    def __init__(self, records: Sequence[PromptRecord], *, prompts_per_step: int, num_steps: int,
                 seed: int = 0, shuffle: bool = True) -> None:
        super().__init__()
        if not records:
            raise ValueError("the training prompt set is empty")
        if prompts_per_step > len(records):
            warnings.warn(
                f"prompts_per_step ({prompts_per_step}) is larger than the {len(records)} "
                "training prompts: every step's batch repeats prompts (see data.limit and "
                "data.max_prompt_length)", UserWarning, stacklevel=2)
        self.records = list(records)
        self.prompts_per_step = prompts_per_step
        self.num_steps = num_steps
        self.seed = seed
        self.shuffle = shuffle
        self.start_step = 0

    @classmethod
    def from_config(cls, conf: TrainConfig, records: Sequence[PromptRecord]
                    ) -> PromptDataModule:
        """The run's prompts: ``conf.prompts_per_step`` per step for ``conf.steps`` steps, in
        the order of ``conf.seed`` (``data.shuffle``)."""
        return cls(records, prompts_per_step=conf.prompts_per_step, num_steps=conf.steps,
                   seed=conf.seed, shuffle=conf.data.shuffle)

    def step_batch(self, step: int, rank: int = 0, world_size: int = 1) -> StepBatch:
        """The batch rank ``rank`` of ``world_size`` trains on at optimizer step
        ``step`` (what the dataloader yields then): for sampling a step's rollouts ahead of
        time (``rollout.async_steps``)."""
        sampler = StepBatchSampler(len(self.records), self.prompts_per_step, self.num_steps,
                                   seed=self.seed, shuffle=self.shuffle, rank=rank,
                                   world_size=world_size)
        share = self.prompts_per_step // world_size
        indices = sampler.batch(step)[rank * share: (rank + 1) * share]
        return StepBatch.of([self.records[i] for i in indices])

    def _current_step(self) -> int:
        return self.trainer.global_step if self.trainer is not None else self.start_step

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        sampler = StepBatchSampler(len(self.records), self.prompts_per_step, self.num_steps,
                                   seed=self.seed, shuffle=self.shuffle,
                                   start_step=self._current_step,
                                   rank=trainer.global_rank if trainer is not None else 0,
                                   world_size=trainer.world_size if trainer is not None else 1)
        return DataLoader(PromptDataset(self.records), batch_sampler=sampler,
                          collate_fn=StepBatch.of, num_workers=0)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "prompts_per_step": self.prompts_per_step,
                "num_prompts": len(self.records)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        current = self.state_dict()
        for key, value in state.items():
            mine = current[key]
            if mine != value:
                raise ValueError(
                    f"cannot resume: the checkpoint's data has {key}={value} but this run has "
                    f"{key}={mine}; the prompt order would differ"
                )
