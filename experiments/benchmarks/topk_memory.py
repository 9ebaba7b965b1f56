"""Benchmark: peak extra memory of the top-k outputs of ``score_tokens`` at Qwen's V = 151,936.

The top-k fields (issue 19: Token Teachability, Entropy-Aware OPD, the top-k KL objectives) are
computed inside the chunked scoring loop, so they must keep its memory flat in V: per chunk a
bool ``[chunk, V]`` mask per top-k list and, only in rows where ties straddle the K-th value, a
copy of those rows. This script measures it. Variants, each in a fresh subprocess (this script
with the hidden ``--variant`` flag), student and teacher both :class:`LMHead` sources:

- ``off``:    ``score_tokens(student, targets, teacher=teacher, entropy=True,
  teacher_entropy=True, kl=True)``: what the full-KL / TIP / FiRe steps compute today;
- ``topk``:   the same plus ``top_k=16, teacher_top_k=32`` (every top-k output: what
  Token Teachability and the top-k KL objectives need, in one pass);
- ``gather``: the student alone with ``gather_ids`` ``[B, T, 32]`` (the path fed by a
  teacher-scoring service's top-k answer), against ``plain``: the student alone, log-probs only;
- ``topk_ties``: as ``topk`` with the teacher's logits rounded to multiples of 0.5 (given as
  precomputed :class:`Logits`, counted in the baseline), so that nearly every row has a tie
  across its K-th value: the worst case of the tie resolution;
- ``off_ties``: ``off`` with the same rounded teacher logits, the reference of ``topk_ties``.

Mode ``nograd`` runs under ``torch.no_grad``; ``--grad`` adds mode ``grad``: forward + backward
of ``logprobs + kl (+ topk_logprobs + logprobs_at_ids)`` summed, w.r.t. the student's hidden
states and head weight.

Peak *extra* memory is measured from a baseline taken after the inputs are allocated (CPU: the
RSS high-water mark reset via ``/proc/self/clear_refs``, peak = VmHWM - VmRSS; CUDA:
``max_memory_allocated - memory_allocated``). One fp32 ``[chunk, V]`` block is printed as the
unit: the chunked scoring's budget is a small multiple (about 4-6) of it, whatever B * T is.

Usage::

    python experiments/benchmarks/topk_memory.py                   # nograd, B=2, T=512
    python experiments/benchmarks/topk_memory.py --grad --out topk_memory.json
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

try:
    from saopd.signals import LMHead, Logits, default_chunk_size, score_tokens
except ModuleNotFoundError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from saopd.signals import LMHead, Logits, default_chunk_size, score_tokens

VARIANTS = ("plain", "gather", "off", "topk", "off_ties", "topk_ties")
K_STUDENT, K_TEACHER = 16, 32


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=2, help="B (default 2)")
    ap.add_argument("--seq", type=int, default=512, help="T (default 512)")
    ap.add_argument("--vocab", type=int, default=151_936, help="V (default 151936)")
    ap.add_argument("--hidden", type=int, default=256, help="H (default 256)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--chunk-size", type=int, default=None,
                    help="positions per chunk (default: default_chunk_size(V))")
    ap.add_argument("--grad", action="store_true", help="also measure forward+backward")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated subset of {','.join(VARIANTS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=["nograd", "grad"], default="nograd",
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in ("batch", "seq", "vocab", "hidden"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    return args


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakMemory:
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
            self.method, self.reset = "VmHWM (reset via clear_refs) - VmRSS", True
        except OSError:
            self.method, self.reset = "ru_maxrss - VmRSS (no reset: may over-estimate)", False
        self.baseline = _status_kib("VmRSS") * 1024

    def peak_extra(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        peak = (_status_kib("VmHWM") * 1024 if self.reset
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        return peak - self.baseline


def _child(args: argparse.Namespace) -> dict[str, Any]:
    device, grad, variant = torch.device(args.device), args.mode == "grad", args.variant
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    shape = (args.batch, args.seq)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*size, generator=gen)).to(device)

    hidden, weight = randn(*shape, args.hidden), randn(args.vocab, args.hidden, scale=0.1)
    t_hidden, t_weight = randn(*shape, args.hidden), randn(args.vocab, args.hidden, scale=0.1)
    targets = torch.randint(0, args.vocab, shape, generator=gen).to(device)
    if variant.endswith("_ties"):  # precomputed, rounded: ties across the K-th value
        teacher: LMHead | Logits = Logits(torch.round(2 * (t_hidden @ t_weight.T)) / 2)
    else:
        teacher = LMHead(t_hidden, t_weight)
    gather_ids = torch.randint(0, args.vocab, (*shape, K_TEACHER), generator=gen).to(device)
    hidden.requires_grad_(grad)
    weight.requires_grad_(grad)

    probe = PeakMemory(device)
    start = time.perf_counter()
    with torch.set_grad_enabled(grad):
        source = LMHead(hidden, weight)
        kw: dict[str, Any] = {"chunk_size": args.chunk_size}
        if variant in ("plain", "gather"):
            if variant == "gather":
                kw["gather_ids"] = gather_ids
        else:
            kw.update(teacher=teacher, entropy=True, teacher_entropy=True, kl=True)
            if variant.startswith("topk"):
                kw.update(top_k=K_STUDENT, teacher_top_k=K_TEACHER)
        scores = score_tokens(source, targets, **kw)
        if grad:
            loss = scores.logprobs.sum()
            for name in ("kl", "topk_logprobs", "logprobs_at_ids"):
                value = getattr(scores, name)
                if value is not None:
                    loss = loss + value.sum()
            loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = probe.peak_extra()
    return {"variant": variant, "mode": args.mode, "seconds": seconds,
            "peak_extra_bytes": peak, "peak_extra_mib": peak / 2**20,
            "memory_method": probe.method}


def _run_child(args: argparse.Namespace, variant: str, mode: str) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--variant", variant, "--mode", mode,
           "--batch", str(args.batch), "--seq", str(args.seq), "--vocab", str(args.vocab),
           "--hidden", str(args.hidden), "--device", args.device, "--seed", str(args.seed)]
    if args.chunk_size is not None:
        cmd += ["--chunk-size", str(args.chunk_size)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{variant}/{mode} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    if args.variant is not None:
        result = _child(args)
        print(json.dumps(result))
        return result
    chunk = args.chunk_size or default_chunk_size(args.vocab)
    block = 4 * chunk * args.vocab  # one fp32 [chunk, V] block
    runs = []
    modes = ["nograd", "grad"] if args.grad else ["nograd"]
    for mode in modes:
        for variant in args.variants.split(","):
            runs.append(_run_child(args, variant, mode))
            r = runs[-1]
            print(f"{mode:6s} {variant:9s} peak extra {r['peak_extra_mib']:8.1f} MiB = "
                  f"{r['peak_extra_bytes'] / block:4.2f} blocks   {r['seconds']:6.1f} s",
                  flush=True)
    summary = {"batch": args.batch, "seq": args.seq, "vocab": args.vocab, "hidden": args.hidden,
               "device": args.device, "chunk_size": chunk, "block_mib": block / 2**20,
               "full_logits_mib": 4 * args.batch * args.seq * args.vocab / 2**20,
               "k_student": K_STUDENT, "k_teacher": K_TEACHER, "torch": torch.__version__,
               "runs": runs}
    print(f"one fp32 [chunk={chunk}, V={args.vocab}] block = {block / 2**20:.1f} MiB; "
          f"plain [B, T, V] fp32 logits would be {summary['full_logits_mib']:.0f} MiB")
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
