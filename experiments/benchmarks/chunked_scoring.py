"""Benchmark: chunked ``score_tokens(LMHead(...))`` against the plain full-logits computation.

Compares, at B x T positions, vocabulary V and hidden size H (defaults: Qwen-like 4 x 2048,
V = 151,936, H = 2048):

- ``naive``:   logits = hidden @ W.T in fp32 ([B, T, V]), log_softmax, gather, entropy;
- ``chunked``: ``score_tokens(LMHead(hidden, W), targets, entropy=True)`` (default chunk size);

under ``torch.no_grad`` (mode ``nograd``), and with ``--grad`` also forward + backward of
``logprobs.sum()`` w.r.t. hidden and W (mode ``grad``; no entropy in either variant).

Each (mode, variant) runs in a fresh subprocess (this script with the hidden ``--variant``
flag), so one variant's allocations cannot hide or inflate the other's. Peak *extra* memory is
measured from a baseline taken right after the inputs are allocated, before any run (no
warm-up, so nothing freed by a warm-up is counted in the baseline):

- CPU: the RSS high-water mark is reset (``/proc/self/clear_refs`` = 5), baseline = VmRSS, peak
  = VmHWM after all runs; if the reset is not possible, peak = ru_maxrss (flagged in
  ``memory_method``), which can only over-estimate the extra memory.
- CUDA: ``reset_peak_memory_stats``; baseline = ``memory_allocated``, peak =
  ``max_memory_allocated`` (tensor memory, not the caching allocator's reserve).

Wall time is the best of ``--repeat`` runs (the first run included in ``times_s``). The children
also save their outputs, and the parent reports the largest |naive - chunked| difference.

Usage::

    python experiments/benchmarks/chunked_scoring.py --repeat 1 --out chunked.json
    python experiments/benchmarks/chunked_scoring.py --seq 512 --grad --repeat 2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

try:
    from saopd.signals import LMHead, default_chunk_size, score_tokens
except ModuleNotFoundError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from saopd.signals import LMHead, default_chunk_size, score_tokens

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4, help="B (default 4)")
    ap.add_argument("--seq", type=int, default=2048, help="T (default 2048)")
    ap.add_argument("--vocab", type=int, default=151_936, help="V (default 151936)")
    ap.add_argument("--hidden", type=int, default=2048, help="H (default 2048)")
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="float32",
                    help="dtype of hidden and W (logits are fp32 in both variants)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--chunk-size", type=int, default=None,
                    help="positions per chunk (default: default_chunk_size(V))")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per variant (best kept)")
    ap.add_argument("--grad", action="store_true", help="also time forward+backward")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--variant", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=["nograd", "grad"], default="nograd",
                    help=argparse.SUPPRESS)
    ap.add_argument("--save", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in ("batch", "seq", "vocab", "hidden", "repeat"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


# ---- memory probes ----------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class _PeakMemory:
    """Peak memory above a baseline taken at construction (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.method = "cuda max_memory_allocated - memory_allocated"
            self.baseline = torch.cuda.memory_allocated(device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self.method = "VmHWM (reset via clear_refs) - VmRSS"
            self.reset = True
        except OSError:
            self.method = "ru_maxrss - VmRSS (no reset: may over-estimate)"
            self.reset = False
        self.baseline = _status_kib("VmRSS") * 1024

    def peak_extra(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        if self.reset:
            peak = _status_kib("VmHWM") * 1024
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return peak - self.baseline


# ---- the two variants -------------------------------------------------------------------------


def _naive(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, grad: bool
           ) -> dict[str, torch.Tensor]:
    """Plain code: full fp32 [B, T, V] logits, then log_softmax / gather / entropy."""
    logp = torch.log_softmax(hidden.float() @ weight.float().T, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if grad:
        lp.sum().backward()
        return {"logprobs": lp.detach()}
    entropy = -(logp.exp() * logp).sum(-1)
    return {"logprobs": lp, "entropy": entropy}


def _chunked(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, grad: bool,
             chunk_size: int | None) -> dict[str, torch.Tensor]:
    scores = score_tokens(LMHead(hidden, weight), targets, entropy=not grad,
                          chunk_size=chunk_size)
    if grad:
        scores.logprobs.sum().backward()
        return {"logprobs": scores.logprobs.detach()}
    return {"logprobs": scores.logprobs, "entropy": scores.entropy}


def _child(args: argparse.Namespace) -> dict[str, Any]:
    device, dtype = torch.device(args.device), _DTYPES[args.dtype]
    grad = args.mode == "grad"
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    hidden = torch.randn(args.batch, args.seq, args.hidden, generator=gen).to(device, dtype)
    weight = (0.02 * torch.randn(args.vocab, args.hidden, generator=gen)).to(device, dtype)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    hidden.requires_grad_(grad)
    weight.requires_grad_(grad)

    probe = _PeakMemory(device)
    times, out = [], {}
    for _ in range(args.repeat):
        hidden.grad = weight.grad = None
        out = {}
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.set_grad_enabled(grad):
            if args.variant == "naive":
                out = _naive(hidden, weight, targets, grad)
            else:
                out = _chunked(hidden, weight, targets, grad, args.chunk_size)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    peak = probe.peak_extra()
    if grad:
        out["grad_weight_norm"] = weight.grad.float().norm().reshape(1)
    if args.save is not None:
        torch.save({k: v.detach().float().cpu() for k, v in out.items()}, args.save)
    return {
        "variant": args.variant, "mode": args.mode, "best_s": min(times), "times_s": times,
        "peak_extra_bytes": peak, "peak_extra_gib": peak / 2**30,
        "memory_method": probe.method, "baseline_bytes": probe.baseline,
    }


# ---- parent -----------------------------------------------------------------------------------


def _run_child(args: argparse.Namespace, variant: str, mode: str, save: Path
               ) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--variant", variant, "--mode", mode,
           "--save", str(save), "--batch", str(args.batch), "--seq", str(args.seq),
           "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--dtype", args.dtype,
           "--device", args.device, "--repeat", str(args.repeat), "--seed", str(args.seed)]
    if args.chunk_size is not None:
        cmd += ["--chunk-size", str(args.chunk_size)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"variant": variant, "mode": mode, "failed": True,
                "returncode": proc.returncode, "stderr_tail": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _main(args: argparse.Namespace) -> dict[str, Any]:
    n = args.batch * args.seq
    chunk = args.chunk_size or default_chunk_size(args.vocab)
    report: dict[str, Any] = {
        "config": {
            "B": args.batch, "T": args.seq, "V": args.vocab, "H": args.hidden,
            "dtype": args.dtype, "device": args.device, "chunk_size": chunk,
            "num_chunks": -(-n // chunk), "repeat": args.repeat,
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "fp32_logits_bytes": n * args.vocab * 4,
            "fp32_chunk_block_bytes": chunk * args.vocab * 4,
        },
        "results": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ["nograd", "grad"] if args.grad else ["nograd"]:
            res, outs = {}, {}
            for variant in ("naive", "chunked"):
                save = Path(tmp) / f"{mode}_{variant}.pt"
                res[variant] = _run_child(args, variant, mode, save)
                print(f"[{mode}] {variant}: {json.dumps(res[variant])}", file=sys.stderr)
                if save.exists():
                    outs[variant] = torch.load(save)
            if not any(r.get("failed") for r in res.values()):
                naive, chunked = res["naive"], res["chunked"]
                res["time_ratio_chunked_over_naive"] = chunked["best_s"] / naive["best_s"]
                res["memory_ratio_chunked_over_naive"] = (
                    chunked["peak_extra_bytes"] / naive["peak_extra_bytes"])
            if len(outs) == 2:
                res["max_abs_diff"] = {
                    key: float((outs["naive"][key] - outs["chunked"][key]).abs().max())
                    for key in outs["naive"]
                }
            report["results"][mode] = res
    return report


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if args.variant is not None:
        print(json.dumps(_child(args)))
        return
    report = _main(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
