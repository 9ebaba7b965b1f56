"""The step's data as data: the rollouts reach ``training_step`` through its batch (a
``StepBatch`` the RolloutCallback fills), and the step's token view reaches the callbacks through
its output."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from saopd.analysis.token_records import StepView
from saopd.lightning.data import StepBatch
from saopd.prompts.text import PromptRecord
from saopd.rollout.base import Rollout, RolloutBatch

RECORDS = [PromptRecord(id=f"p{i}", messages=[{"role": "user", "content": f"{i} + {i} = ?"}],
                        answer=str(2 * i), source="test") for i in range(3)]


def test_a_step_batch_takes_only_rollouts_for_its_prompts() -> None:
    batch = StepBatch.of(RECORDS)
    assert batch.ids == ["p0", "p1", "p2"] and batch.answers == ["0", "2", "4"]
    assert batch.messages == [r.messages for r in RECORDS]
    batch.messages[0][0]["content"] = "changed"  # a copy: the records are untouched
    assert RECORDS[0].messages[0]["content"] == "0 + 0 = ?"
    with pytest.raises(RuntimeError, match="RolloutCallback"):
        batch.take_rollouts()
    with pytest.raises(ValueError, match="for 2 prompts, not this step's 3"):
        batch.attach_rollouts(RolloutBatch(messages=batch.messages[:2]))
    batch.attach_rollouts(RolloutBatch(messages=batch.messages), started=1.5)
    with pytest.raises(RuntimeError, match="no responses"):
        batch.take_rollouts()
    rollouts = RolloutBatch(messages=batch.messages,
                            rollouts=[Rollout(prompt_index=1, response_ids=[5, 6])])
    batch.attach_rollouts(rollouts, started=2.0)
    assert batch.take_rollouts() is rollouts and batch.started == 2.0


def _fixed_ids(step: int, row: int) -> list[int]:
    return [10 + step, 20 + row, 30 + step + row][: 2 + (row + step) % 2]


class _Replace(L.Callback):
    """Runs after the RolloutCallback: attaches other rollouts to the step's batch."""

    def __init__(self) -> None:
        self.sent: list[list[list[int]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        assert isinstance(batch, StepBatch) and batch.rollouts is not None  # sampled already
        step = trainer.global_step
        rollouts = [Rollout(prompt_index=i, response_ids=_fixed_ids(step, i))
                    for i in range(len(batch.messages))]
        self.sent.append([r.response_ids for r in rollouts])
        batch.attach_rollouts(RolloutBatch(messages=batch.messages, rollouts=rollouts))


class _Seen(L.Callback):
    def __init__(self) -> None:
        self.views: list[StepView] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        assert isinstance(outputs["loss"], torch.Tensor)
        self.views.append(outputs["view"])


def test_the_step_trains_on_the_rollouts_of_its_batch(make_cfg) -> None:
    from saopd.train import train

    replace, seen = _Replace(), _Seen()
    train(make_cfg("experiment=tiny", "steps=2", "prompts_per_step=3", "rollout.n=1",
                   mlflow=False), extra_callbacks=[replace, seen])
    assert [v.step for v in seen.views] == [0, 1]
    for sent, view in zip(replace.sent, seen.views, strict=True):
        got = [[int(t) for t, ok in zip(ids, valid, strict=True) if ok]
               for ids, valid in zip(view.response_ids.tolist(), view.valid.tolist(),
                                     strict=True)]
        assert got == sent  # the step scored what was attached to its batch, nothing else
        assert view.filtered.shape == view.valid.shape
