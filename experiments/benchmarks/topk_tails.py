"""Accuracy of the top-k KL objectives against a float64 full-vocabulary reference.

Issue 25: with the tail taken from the teacher's float32 top-K list alone, a teacher tail below
~1e-7 rounds the listed mass to 1 and the lumped KL's tail term used a -100 floor (reverse
top-k KL 33.6 instead of 5.0 at a tail of 8e-8). The chunked scoring now computes each side's
mass outside the K ids exactly; this script measures what the objectives give.

For each teacher tail mass (1e-3 ... 1e-11), each student (``diffuse``: Gaussian logits of
scale 2; ``close``: the teacher's logits plus unit Gaussian noise, so its tail is as small),
each direction and each ``tail`` mode, the float32 pipeline (``score_tokens`` on ``Logits`` ->
``TokenSignals`` -> ``objective=topk_kl``) is compared with the same KL written directly in
float64 from the same float32 logits over the whole vocabulary (V = 1000, K = 16, 2 x 3
positions). Printed: the largest relative error of the per-position values, and the relative
error (2-norm) of the gradient w.r.t. the student's logits. Rows ``lists`` take the teacher's
tail from its list alone (what a teacher-scoring service gives): exact down to the floor at a
tail of 1e-6, which is the reference there.

Usage::

    .venv/bin/python experiments/benchmarks/topk_tails.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

try:
    from tests.helpers.topk_reference import B, T, logits_with_tail, reference_kl, run_topk_kl
except ModuleNotFoundError:  # run as a script: the repository root is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.helpers.topk_reference import B, T, logits_with_tail, reference_kl, run_topk_kl

from saopd.objectives import TOPK_TAILS
from saopd.signals.topk import LIST_TAIL_FLOOR

TAILS = (1e-3, 1e-6, 8e-8, 1e-8, 1e-11)


def measure(tail_mass: float, student: str, direction: str, tail: str,
            lists_only: bool = False) -> dict[str, float]:
    z_s, z_t = logits_with_tail(tail_mass, student)
    out, grad, signals = run_topk_kl(z_s, z_t, lists_only=lists_only, direction=direction,
                                     tail=tail)
    kl = out.loss.detach()
    ids = signals.teacher_topk_ids
    assert ids is not None
    ref_z = z_s.double().requires_grad_(True)
    floor = torch.full((B, T), LIST_TAIL_FLOOR, dtype=torch.float64) if lists_only else None
    ref = reference_kl(ref_z, z_t, ids, direction, tail, floor)
    ref.sum().backward()
    assert ref_z.grad is not None
    value_err = ((kl.double() - ref.detach()).abs() / ref.detach().abs()).max().item()
    grad_err = ((grad.double() - ref_z.grad).norm() / ref_z.grad.norm()).item()
    return {"tail": tail_mass, "student": student, "direction": direction, "mode": tail,
            "lists_only": lists_only, "kl_mean": ref.detach().mean().item(),
            "value_rel_err": value_err, "grad_rel_err": grad_err}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args()
    rows = [measure(t, s, d, m) for t in TAILS for s in ("diffuse", "close")
            for d in ("forward", "reverse") for m in TOPK_TAILS]
    rows += [measure(t, s, d, "lumped", lists_only=True) for t in (1e-8, 1e-11)
             for s in ("diffuse", "close") for d in ("forward", "reverse")]
    print(f"{'teacher tail':>12} {'student':>8} {'direction':>9} {'tail':>12} "
          f"{'KL (mean)':>10} {'value err':>10} {'grad err':>10}")
    for r in rows:
        mode = r["mode"] + (" (lists)" if r["lists_only"] else "")
        print(f"{r['tail']:12.0e} {r['student']:>8} {r['direction']:>9} {mode:>12} "
              f"{r['kl_mean']:10.4g} {r['value_rel_err']:10.2e} {r['grad_rel_err']:10.2e}")
    worst = max(max(r["value_rel_err"], r["grad_rel_err"]) for r in rows)
    print(f"worst relative error: {worst:.2e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
