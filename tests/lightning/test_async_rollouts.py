"""One-step-off rollouts (``rollout.async_steps=1``): step k+1 is sampled while step k trains,
from weights one optimizer step old, with step k+1's own prompts and seed.

The engine is HF ``generate`` on a separate copy of the student (``load_weights`` copies the
trained weights into it after each step): an engine with its own weights, as vLLM is, on CPU.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest

import saopd.train as train_module
from saopd.config import to_train_config
from saopd.rollout.hf import HFGenerateEngine
from saopd.train import train


class Recorder(L.Callback):
    """The responses each step trained on, and the step's rollout staleness."""

    def __init__(self) -> None:
        self.responses: list[list[list[int]]] = []
        self.staleness: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.responses.append([list(r.response_ids) for r in batch.rollouts.rollouts])
        value = trainer.callback_metrics.get("train/rollout_staleness")
        self.staleness.append(float(value) if value is not None else -1.0)


def _copy_engine(frozen: bool):
    def build(conf: Any, pair: Any) -> HFGenerateEngine:
        engine = HFGenerateEngine(copy.deepcopy(pair.student), pair.tokenizer,
                                  max_prompt_length=conf.data.max_prompt_length)
        engine.holds_weights = True  # its own copy: synced after every step
        if frozen:  # never synced: samples from the initial weights at every step
            engine.load_weights = lambda named: None
        return engine
    return build


def _run(make_cfg, monkeypatch, *extra: str, frozen: bool = False) -> Recorder:
    monkeypatch.setattr(train_module, "build_run_engine", _copy_engine(frozen))
    recorder = Recorder()
    train(make_cfg("experiment=tiny", "steps=3", "rollout=vllm", "rollout.in_process=false",
                   "rollout.n=1", *extra, mlflow=False),
          extra_callbacks=[recorder])
    return recorder


BIG_STEPS = ("optim.lr=0.05", "optim.grad_clip=null")  # one step changes what is sampled


def test_one_step_off_samples_from_the_weights_one_step_old(make_cfg, monkeypatch) -> None:
    sync = _run(make_cfg, monkeypatch, *BIG_STEPS)
    stale = _run(make_cfg, monkeypatch, *BIG_STEPS, "rollout.async_steps=1")
    frozen = _run(make_cfg, monkeypatch, *BIG_STEPS, frozen=True)
    assert stale.staleness == [0.0, 1.0, 1.0]
    assert sync.staleness == [-1.0] * 3  # not logged when off
    # step 0: everyone samples from the initial weights
    assert stale.responses[0] == sync.responses[0] == frozen.responses[0]
    # step 1 was sampled while step 0 trained, from the initial weights: what an engine that
    # never synced samples at step 1 (same prompts, same seed), not what the synced one does
    assert stale.responses[1] == frozen.responses[1]
    assert sync.responses[1] != frozen.responses[1]  # the update changed the samples


def test_one_step_off_with_unchanged_weights_is_the_synchronous_run(make_cfg,
                                                                   monkeypatch) -> None:
    """With an engine whose weights never change, sampling ahead must give exactly the
    synchronous run: the prompts and seeds of every step are the ones the step would use."""
    sync = _run(make_cfg, monkeypatch, *BIG_STEPS, frozen=True)
    stale = _run(make_cfg, monkeypatch, *BIG_STEPS, "rollout.async_steps=1", frozen=True)
    assert stale.responses == sync.responses and len(sync.responses) == 3


@pytest.mark.parametrize(("overrides", "match"), [
    (["rollout.async_steps=1"], r"async_steps=1 needs an engine with its own copy"),
    (["rollout=vllm", "rollout.async_steps=1"], r"async_steps=1 with rollout=vllm needs "
                                                 r"rollout.in_process=false"),
    (["rollout=vllm", "rollout.in_process=false", "rollout.async_steps=2"],
     r"rollout.async_steps must be one of \[0, 1\]"),
])
def test_async_rollouts_are_refused_where_they_cannot_work(make_cfg, overrides, match) -> None:
    with pytest.raises(ValueError, match=match):
        to_train_config(make_cfg("experiment=tiny", *overrides, mlflow=False))
