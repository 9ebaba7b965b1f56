"""Benchmark: SA-OPD's filter on a large batch of valid tokens (issue: < 100 ms at 2^20 tokens).

Times :func:`saopd.filters.spurious_token_mask` for every branch of Algorithm 2 (fixed ratios, the
paper's upper bound only, growing to a lower bound, growing then shrinking) and both extreme-set
definitions, on ``--tokens`` valid tokens (default 1,048,576) laid out as [B, T]. Reports the
best and median of ``--repeat`` runs after one warm-up, as JSON.

    .venv/bin/python experiments/benchmarks/filter_speed.py [--tokens N] [--repeat R] [--out F]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from saopd.filters import spurious_token_mask

CASES = {
    "fixed": {},
    "shrink (beta_max=0.018, the paper's VU setting)": {"beta_max": 0.018},
    "grow (beta_min=0.5, beta_max=0.9)": {"beta_min": 0.5, "beta_max": 0.9},
    "grow_then_shrink (beta_min=0.5, beta_max=0.5000001)": {"beta_min": 0.5,
                                                             "beta_max": 0.5000001},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--length", type=int, default=2048, help="T; B = tokens / T")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=str, default=None, help="also write the JSON here")
    args = parser.parse_args()

    g = torch.Generator().manual_seed(args.seed)
    b, t = max(1, args.tokens // args.length), args.length
    a_full = torch.randn(b, t, generator=g)  # A_full
    delta = torch.rand(b, t, generator=g)  # grounding gap
    valid = torch.ones(b, t, dtype=torch.bool)

    results = []
    for extreme in ("abs", "two_sided"):
        for label, bounds in CASES.items():
            times = []
            out = None
            for i in range(args.repeat + 1):
                start = time.perf_counter()
                out = spurious_token_mask(a_full, delta, valid, p1=0.2, p2=0.3, extreme=extreme,
                                          **bounds)
                if i:  # the first run is a warm-up
                    times.append(time.perf_counter() - start)
            assert out is not None
            results.append({
                "extreme": extreme, "case": label, "branch": out.branch,
                "alpha": round(out.alpha, 6), "flmr": round(out.flmr, 6),
                "filtered_tokens": int(out.mask.sum()),
                "best_ms": round(min(times) * 1e3, 2),
                "median_ms": round(statistics.median(times) * 1e3, 2),
            })
            row = results[-1]
            print(f"{extreme:9s} {label:52s} {row['branch']:17s} best {row['best_ms']:8.2f} ms"
                  f"  median {row['median_ms']:8.2f} ms", flush=True)
    report = {
        "benchmark": "filter_speed", "valid_tokens": b * t, "shape": [b, t],
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": platform.machine(), "results": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
