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
import math

import torch

from saopd.filters import build_filter
from saopd.objectives import TOPK_TAILS, build_objective
from saopd.signals import Logits, TokenSignals, score_tokens
from saopd.signals.topk import LIST_TAIL_FLOOR

V, K, B, T = 1000, 16, 2, 3
TAILS = (1e-3, 1e-6, 8e-8, 1e-8, 1e-11)


def logits_with_tail(tail: float, student: str, seed: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[B, T, V]`` (student, teacher) logits; the teacher's K largest hold all but
    ``tail`` of its mass (in float64, before the cast)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randn(B, T, K, generator=g, dtype=torch.float64)
    rest = torch.randn(B, T, V - K, generator=g, dtype=torch.float64)
    shift = (rest.logsumexp(-1) + math.log1p(-tail) - math.log(tail) - head.logsumexp(-1))
    ordered = torch.cat([head + shift[..., None], rest], dim=-1)
    perm = torch.rand(B, T, V, generator=g).argsort(-1)
    teacher = torch.empty_like(ordered).scatter_(-1, perm, ordered)
    noise = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    stud = 2 * noise if student == "diffuse" else teacher + noise
    return stud.float(), teacher.float()


def reference(z_s: torch.Tensor, z_t: torch.Tensor, ids: torch.Tensor, direction: str,
              tail: str, teacher_tail: torch.Tensor | None = None) -> torch.Tensor:
    """float64 ``[B, T]`` KL from full-vocabulary log-softmaxes (``z_s`` may require grad);
    ``teacher_tail`` replaces the teacher's exact log tail (the list-only rows)."""
    lp, lq = torch.log_softmax(z_s.double(), -1), torch.log_softmax(z_t.double(), -1)
    a_s, a_t = lp.gather(-1, ids), lq.gather(-1, ids)
    if tail == "renormalize":
        a_s, a_t = a_s.log_softmax(-1), a_t.log_softmax(-1)
    x, y = (a_t, a_s) if direction == "forward" else (a_s, a_t)
    out = (x.exp() * (x - y)).sum(-1)
    if tail == "lumped":
        t_s = lp.scatter(-1, ids, float("-inf")).logsumexp(-1)
        t_t = lq.scatter(-1, ids, float("-inf")).logsumexp(-1)
        if teacher_tail is not None:
            t_t = teacher_tail
        tx, ty = (t_t, t_s) if direction == "forward" else (t_s, t_t)
        out = out + tx.exp() * (tx - ty)
    return out


def pipeline(z_s: torch.Tensor, z_t: torch.Tensor, direction: str, tail: str,
             lists_only: bool = False) -> tuple[torch.Tensor, torch.Tensor, TokenSignals]:
    """(float32 KL ``[B, T]``, d sum(KL) / d z_s, the signals) through the chunked scoring."""
    z = z_s.clone().requires_grad_(True)
    targets = torch.zeros(B, T, dtype=torch.long)
    sc = score_tokens(Logits(z), targets, teacher=Logits(z_t), teacher_top_k=K, chunk_size=4)
    signals = TokenSignals(
        lp_student=sc.logprobs, lp_teacher=sc.teacher_logprobs,
        valid=torch.ones(B, T, dtype=torch.bool), teacher_topk_ids=sc.teacher_topk_ids,
        teacher_topk_lp_teacher=sc.teacher_topk_logprobs,
        teacher_topk_lp_student=sc.logprobs_at_ids,
        teacher_topk_tail_teacher=None if lists_only else sc.teacher_topk_tail,
        teacher_topk_tail_student=sc.tail_at_ids)
    objective = build_objective("topk_kl", direction=direction, top_k=K, tail=tail)
    out = objective(signals, build_filter("none")(signals))
    out.loss.sum().backward()
    assert z.grad is not None
    return out.loss.detach(), z.grad, signals


def measure(tail_mass: float, student: str, direction: str, tail: str,
            lists_only: bool = False) -> dict[str, float]:
    z_s, z_t = logits_with_tail(tail_mass, student)
    kl, grad, signals = pipeline(z_s, z_t, direction, tail, lists_only)
    ids = signals.teacher_topk_ids
    assert ids is not None
    ref_z = z_s.double().requires_grad_(True)
    floor = torch.full((B, T), LIST_TAIL_FLOOR, dtype=torch.float64) if lists_only else None
    ref = reference(ref_z, z_t, ids, direction, tail, floor)
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
