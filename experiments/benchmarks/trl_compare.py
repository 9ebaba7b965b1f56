"""Benchmark: saopd's training step against TRL's on-policy distillation trainer, side by side.

Both sides train the same pair (the 10-layer pruned SmolLM2-135M-Instruct student against the
30-layer SmolLM2-135M-Instruct teacher, fp32, CPU) with the same loss, batch, lengths and
sampling:

- saopd: ``saopd-train`` in process (``experiment=smollm2_gsm8k filter=none
  objective=full_kl``: exact reverse KL over the vocabulary at every response token, token-mean,
  Lightning, HF ``generate`` rollouts from the live student);
- TRL: ``trl.DistillationTrainer`` (TRL 1.16's on-policy distillation trainer, the successor of
  GKDTrainer with lmbda = 1: every step generates from the student) with ``beta=1.0`` (reverse KL
  over the vocabulary, its chunked path), ``gradient_checkpointing=False`` (saopd's default; TRL
  defaults to True), ``bf16=False`` (CPU, fp32 as saopd);

``--prompts`` GSM8K train prompts per step, one sample each, up to ``--new-tokens`` new tokens at
temperature 1.0, top-p 1.0, AdamW at lr 1e-5, gradient clipping at 1.0. Each side runs in its own
process (so peak memory is its own), ``--rounds`` times alternately; a step's time is the wall
time between the ends of consecutive steps (sampling, scoring, backward, optimizer: the whole
step), the first step is a warm-up. Peak memory: the process's high-water RSS at the end of its
last step, and the same minus the RSS once both models were loaded ("extra").

    make setup-trl
    .venv-trl/bin/python experiments/benchmarks/trl_compare.py --out docs/figures/trl_compare.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[2]


def rss_mib() -> float:
    """Current resident set size (MiB), from /proc."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mib() -> float:
    """High-water resident set size of this process so far (MiB; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def gsm8k_prompts(n: int, seed: int) -> list[list[dict[str, str]]]:
    from saopd.prompts.text import GSM8K_DIR, gsm8k_records

    records, _ = gsm8k_records(GSM8K_DIR / "train.jsonl")
    return [r.messages for r in random.Random(seed).sample(records, n)]


def run_saopd(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    from hydra import compose, initialize_config_dir

    from saopd.train import CONF_DIR, train

    marks: dict[str, Any] = {"ends": []}

    class Clock(L.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            marks["start"], marks["rss_loaded"] = time.perf_counter(), rss_mib()

        def on_train_batch_end(self, *a: Any, **k: Any) -> None:
            marks["ends"].append(time.perf_counter())
            marks["peak"] = peak_mib()

    with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(config_dir=CONF_DIR,
                                                                     version_base="1.3"):
        cfg = compose("train", overrides=[
            f"paths.root={REPO}", f"paths.output_dir={tmp}/run", "experiment=smollm2_gsm8k",
            "filter=none", "objective=full_kl", f"steps={args.steps}",
            f"prompts_per_step={args.prompts}", f"rollout.max_new_tokens={args.new_tokens}",
            "rollout.temperature=1.0", "rollout.top_p=1.0", "optim.lr=1e-5",
            "optim.warmup_steps=0", "optim.grad_clip=1.0", "logger=none",
            f"trainer.checkpoint_every_n_steps={args.steps + 1}", "trainer.view_every_n_steps=0",
            "trainer.progress_bar=false", "step.log_entropy=false", f"seed={args.seed}"])
        train(cfg, extra_callbacks=[Clock()])
    return marks


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    from saopd.config.model import ModelConfig
    from saopd.models.factory import build_model

    student, tok = build_model(ModelConfig(name_or_path="saopd:smollm2-135m-instruct",
                                           prune_every=3))
    teacher, _ = build_model(ModelConfig(name_or_path="saopd:smollm2-135m-instruct"))
    marks: dict[str, Any] = {"ends": []}

    class Clock(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            marks["start"], marks["rss_loaded"] = time.perf_counter(), rss_mib()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            marks["ends"].append(time.perf_counter())
            marks["peak"] = peak_mib()

    n = args.steps * args.prompts
    data = Dataset.from_list([{"prompt": m} for m in gsm8k_prompts(n, args.seed)])
    with tempfile.TemporaryDirectory() as tmp:
        config = DistillationConfig(
            output_dir=tmp, per_device_train_batch_size=args.prompts,
            gradient_accumulation_steps=1, max_steps=args.steps, learning_rate=1e-5,
            lr_scheduler_type="constant", max_grad_norm=1.0, beta=1.0, temperature=1.0,
            top_p=1.0, max_completion_length=args.new_tokens, bf16=False, fp16=False,
            gradient_checkpointing=False, use_cpu=True, report_to=[], save_strategy="no",
            logging_steps=1, seed=args.seed, dataloader_num_workers=0,
            torch_empty_cache_steps=None)
        trainer = DistillationTrainer(model=student, teacher_model=teacher, args=config,
                                      train_dataset=data, processing_class=tok,
                                      callbacks=[Clock()])
        torch.manual_seed(args.seed)
        trainer.train()
    return marks


def child(args: argparse.Namespace) -> None:
    import torch

    started = time.perf_counter()
    marks = run_saopd(args) if args.side == "saopd" else run_trl(args)
    ends = marks["ends"]
    steps = [b - a for a, b in zip([marks["start"], *ends[:-1]], ends, strict=True)]
    print("RESULT " + json.dumps({
        "side": args.side, "step_s": steps, "rss_loaded_mib": marks["rss_loaded"],
        "peak_rss_mib": marks["peak"], "threads": torch.get_num_threads(),
        "seconds": time.perf_counter() - started}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", choices=["saopd", "trl"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--steps", type=int, default=4, help="steps per run (first = warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs per side")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.side:
        child(args)
        return

    import torch
    import transformers
    import trl

    load_start = os.getloadavg()
    results: dict[str, list[dict[str, Any]]] = {"saopd": [], "trl": []}
    for r in range(args.rounds):
        for side in ("saopd", "trl"):
            cmd = [sys.executable, __file__, "--side", side, "--prompts", str(args.prompts),
                   "--new-tokens", str(args.new_tokens), "--steps", str(args.steps),
                   "--seed", str(args.seed)]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if out.returncode or not line:
                print(out.stdout[-3000:], out.stderr[-6000:], file=sys.stderr)
                raise SystemExit(f"{side} run failed (exit {out.returncode})")
            res = json.loads(line[-1][len("RESULT "):])
            results[side].append(res)
            print(f"round {r} {side}: steps {[round(s, 2) for s in res['step_s']]} s, peak "
                  f"{res['peak_rss_mib']:.0f} MiB (loaded {res['rss_loaded_mib']:.0f})",
                  flush=True)

    def summary(side: str) -> dict[str, float]:
        steps = [s for res in results[side] for s in res["step_s"][1:]]  # drop warm-ups
        peaks = [res["peak_rss_mib"] for res in results[side]]
        extra = [res["peak_rss_mib"] - res["rss_loaded_mib"] for res in results[side]]
        return {"median_step_s": statistics.median(steps), "steps_measured": len(steps),
                "peak_rss_mib": max(peaks), "peak_extra_mib": max(extra)}

    s, t = summary("saopd"), summary("trl")
    report = {
        "benchmark": "trl_compare", "prompts_per_step": args.prompts,
        "max_new_tokens": args.new_tokens, "steps_per_run": args.steps, "rounds": args.rounds,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "trl": trl.__version__, "load_average_start": load_start,
        "load_average_end": os.getloadavg(), "saopd": s, "trl_": t,
        "speedup_trl_over_saopd_step_time": round(t["median_step_s"] / s["median_step_s"], 3),
        "peak_rss_ratio_saopd_over_trl": round(s["peak_rss_mib"] / t["peak_rss_mib"], 3),
        "peak_extra_ratio_saopd_over_trl": round(s["peak_extra_mib"] / t["peak_extra_mib"], 3),
        "runs": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
