"""One tiny training run under a given strategy, launched by tests/integration (not a test).

Lightning's DDP / ModelParallel launchers re-run this script once per extra rank. The rollouts
are fixed (a pure function of the prompt, never of the rank or the batch split), so a run with
W ranks and a single-process run see the same global batch and must take the same steps.

    python tests/integration/dist_worker.py OUT STRATEGY DEVICES [OVERRIDE ...]

Rank 0 writes OUT/losses.json (the logged train/loss and train/flmr of every step) and the
student's final weights come from OUT/run/checkpoints/last.ckpt.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from hydra import compose, initialize_config_dir

from saopd.rollout.base import Rollout, RolloutBatch
from saopd.train import CONF_DIR, train


def fixed_response(messages: list[dict], vocab: int, step: int) -> list[int]:
    """5-12 token ids drawn from a generator seeded by the prompt text and the step."""
    key = hashlib.sha256((json.dumps(messages) + str(step)).encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
    length = int(torch.randint(5, 13, (1,), generator=g))
    return torch.randint(10, vocab, (length,), generator=g).tolist()


class FixedRollouts(L.Callback):
    """Replaces the sampled rollouts of each step by fixed ones (2 per prompt)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        messages = batch.messages
        rollouts = [Rollout(prompt_index=i, response_ids=fixed_response(m, self.vocab,
                                                                        trainer.global_step + k))
                    for i, m in enumerate(messages) for k in range(2)]
        batch.attach_rollouts(RolloutBatch(messages=list(messages), rollouts=rollouts))


class Losses(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path, self.rows = path, []

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.world_size == 1:  # the weights before any step, to show that steps move them
            torch.save({f"student.{k}": v.detach().clone()
                        for k, v in pl_module.student.state_dict().items()},
                       self.path.with_name("initial_student.pt"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        m = trainer.callback_metrics
        self.rows.append({k: float(m[f"train/{k}"]) for k in ("loss", "flmr", "filtered_ratio")
                          if f"train/{k}" in m})
        if trainer.is_global_zero:
            self.path.write_text(json.dumps(self.rows))


def main() -> None:
    out, strategy, devices, *extra = sys.argv[1:]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    overrides = [
        f"paths.root={Path(CONF_DIR).parent}", f"paths.output_dir={out / 'run'}", "logger=none",
        "experiment=tiny", "steps=2", "prompts_per_step=4", "rollout.n=1",
        "trainer.view_every_n_steps=0", f"trainer.strategy={strategy}",
        f"trainer.devices={devices}", "filter.p1=0.4", "filter.p2=0.4", *extra,
    ]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    train(cfg, extra_callbacks=[FixedRollouts(vocab=200), Losses(out / "losses.json")])


if __name__ == "__main__":
    main()
