"""One tiny training run with vLLM rollouts under a given strategy, launched by
test_vllm_ranks.py (not a test).

Lightning's DDP / ModelParallel launchers re-run this script once per extra rank, and every rank
owns a colocated vLLM engine (rollout=vllm). Rollouts are greedy, so they are a function of the
student's weights and the prompt only: W ranks and one process must sample the same responses at
every step, which holds only if every rank's engine got the updated weights after each step.

    python tests/integration/vllm/dist_vllm_worker.py OUT STRATEGY DEVICES [OVERRIDE ...]

Every rank writes OUT/rollouts_rank<R>.json (per step: its prompts' messages and responses),
OUT/sampled_rank<R>.json (its step-0 prompts sampled once more, not greedily: n=2 at
temperature 1 with the seed the run's rollouts of that step and rank use, from the weights the
step's rollouts came from) and OUT/engine_rank<R>.json (how its engine is laid out: tensor
parallelism, its embedding shard's rows, the tensors the last sync check compared, the CPUs
this rank may use and those of each process under it, e.g. its engine's worker); rank 0
writes OUT/losses.json; the final student is OUT/run/checkpoints/last.ckpt.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import lightning as L
import psutil
from hydra import compose, initialize_config_dir

from saopd.train import CONF_DIR, train


class Record(L.Callback):
    """Each rank's sampled responses (and rank 0's logged losses), step by step."""

    def __init__(self, out: Path) -> None:
        self.out, self.rollouts, self.losses = out, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        view = outputs["view"]
        self.rollouts.append({"messages": [m[-1]["content"] for m in view.messages],
                              "responses": [[int(t) for t, ok in zip(ids, valid, strict=True)
                                             if ok] for ids, valid in
                                            zip(view.response_ids.tolist(),
                                                view.valid.tolist(), strict=True)]})
        path = self.out / f"rollouts_rank{trainer.global_rank}.json"
        path.write_text(json.dumps(self.rollouts))
        m = trainer.callback_metrics
        self.losses.append({k: float(m[f"train/{k}"]) for k in ("loss", "flmr", "filtered_ratio")
                            if f"train/{k}" in m})
        if trainer.is_global_zero:
            (self.out / "losses.json").write_text(json.dumps(self.losses))
        engine = next(c.engine for c in trainer.callbacks
                      if type(c).__name__ == "RolloutCallback")
        if "llm" in engine.__dict__:
            shapes = engine.llm.collective_rpc("saopd_param_shapes")[0]
            (self.out / f"engine_rank{trainer.global_rank}.json").write_text(json.dumps({
                "colocated_tensor_parallel": engine.colocated_tensor_parallel,
                "vllm_tensor_parallel_size":
                    engine.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size,
                "embed_rows": shapes["model.embed_tokens.weight"][0],
                "vocab_size": pl_module.student.config.vocab_size,
                "sync_checked": engine.last_sync_checked,
                "allowed_cpus": sorted(os.sched_getaffinity(0)),
                "descendant_cpus": [sorted(p.cpu_affinity())
                                    for p in psutil.Process().children(recursive=True)]}))


class SampleStepZero(L.Callback):
    """Step 0's prompts of this rank sampled with n=2 at temperature 1 by the run's engine
    (every rank calls it at the same point: a tensor-parallel engine samples as a group)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx != 0:
            return
        cb = next(c for c in trainer.callbacks if type(c).__name__ == "RolloutCallback")
        engine, base = cb.engine, cb.sampling
        # the seed the run's step 0 gives this rank (RolloutCallback: seed + step + 1_000_003
        # * rank), so that one engine per rank and a shared one are asked for the same draws
        sampling = dataclasses.replace(base, n=2, temperature=1.0,
                                       seed=base.seed + 1_000_003 * trainer.global_rank)
        greedy, engine.greedy = engine.greedy, False
        try:
            got = engine.generate(batch.messages, sampling)
        finally:
            engine.greedy = greedy
        (self.out / f"sampled_rank{trainer.global_rank}.json").write_text(json.dumps({
            "messages": [m[-1]["content"] for m in batch.messages],
            "responses": [r.response_ids for r in got.rollouts]}))


def main() -> None:
    out, strategy, devices, *extra = sys.argv[1:]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    overrides = [
        f"paths.root={Path(CONF_DIR).parent}", f"paths.output_dir={out / 'run'}", "logger=none",
        "experiment=tiny", "steps=2", "prompts_per_step=4", "rollout=vllm", "rollout.n=1",
        "rollout.greedy=true", "rollout.max_new_tokens=8", "rollout.kv_cache_gb=0.25",
        "rollout.enforce_eager=true", "rollout.max_model_len=1024",
        "rollout.startup_timeout=300", "trainer.view_every_n_steps=0",
        f"trainer.strategy={strategy}", f"trainer.devices={devices}", "filter.p1=0.4",
        "filter.p2=0.4", "optim.lr=0.05", "optim.eps=1.0", "optim.grad_clip=null", *extra,
    ]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    train(cfg, extra_callbacks=[Record(out), SampleStepZero(out)])


if __name__ == "__main__":
    main()
