"""Benchmark: SA-OPD's step time over vanilla OPD, and what each way of cheapening the residual
passes saves, on one sampled batch, in one run.

The batch: the 10-layer pruned SmolLM2 student samples ``--batch`` responses of up to
``--length`` tokens to GSM8K prompts (timed once: the rollout both methods share); the
SmolLM2-135M-Instruct teacher scores them. Then, alternating, medians of ``--repeat`` after a
warm-up:

- ``vanilla`` / ``sa_opd``: the training step after sampling (as ``step_overhead.py``: frozen
  passes, student forward with grad, filter, loss, backward); ``sa_opd_stacked``: the same
  with the teacher's full and residual passes stacked in one forward
  (``score_frozen(stack_teacher=True)``);
- ``residual_full``: the two residual passes (teacher, student) as the step runs them;
- ``residual_trimmed``: the same passes with rows that hold no SA-OPD candidate skipped and every
  kept row cut after its last candidate (the batch is cut at the longest kept prefix), i.e. the
  most that skipping can save (:mod:`saopd.scoring.residual_plan`);
- ``teacher_two_calls`` / ``teacher_one_call``: the teacher's full and residual passes as two
  forwards or as one forward over the 2B rows (right-padded to the longer context).

It also reports the candidate structure at p2 = 0.3 (and 0.1, about the effective p2 under the
paper's FLMR bound): rows without a candidate, response slots after the last candidate, and
whether the exactness certificate (:func:`~saopd.scoring.residual_plan.certify_selection`)
holds, i.e. whether skipping would be exact at all.

    .venv/bin/python experiments/benchmarks/residual_savings.py \\
        --out docs/figures/residual_savings.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any

import torch

from saopd.config.model import ModelConfig
from saopd.contexts.batch import ContextBatch, PairedContextBatch
from saopd.contexts.text import collate_contexts
from saopd.filters import FILTERS
from saopd.models.factory import build_model
from saopd.objectives import OBJECTIVES, aggregate
from saopd.prompts.text import GSM8K_DIR, gsm8k_records
from saopd.rollout.base import SamplingParams
from saopd.rollout.hf import HFGenerateEngine
from saopd.scoring.passes import ScoringNeeds, response_source, score_frozen, score_student
from saopd.scoring.residual_plan import candidate_mask, certify_selection, residual_stops
from saopd.signals import score_tokens


def step(student: Any, teacher: Any, batch: PairedContextBatch, token_filter: Any,
         objective: Any, stack_teacher: bool = False) -> float:
    """Seconds of one training step after sampling (as step_overhead.py)."""
    needs = ScoringNeeds.from_fields(token_filter.needs, objective.needs)
    t0 = time.perf_counter()
    frozen = score_frozen(batch, student=student, teacher=teacher, reference=None, needs=needs,
                          stack_teacher=stack_teacher)
    signals = score_student(batch, frozen, student=student, needs=needs)
    result = token_filter(signals)
    aggregate(objective(signals, result).loss, result.keep).backward()
    student.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


@torch.no_grad()
def lp(model: Any, ctx: ContextBatch, targets: torch.Tensor) -> torch.Tensor:
    return score_tokens(response_source(model, ctx), targets).logprobs


def trim(ctx: ContextBatch, targets: torch.Tensor, stops: torch.Tensor
         ) -> tuple[ContextBatch, torch.Tensor, torch.Tensor]:
    """The residual context cut to the rows with a candidate and the columns up to the longest
    kept prefix; returns (context, targets, kept row indices)."""
    rows = (stops > 0).nonzero()[:, 0]
    s = stops[rows]
    r_max = int(s.max())
    needed = ctx.gather_index[rows, s - 1] + 1  # tokens each kept row must run through
    t_max = int(needed.max())
    index = ctx.gather_index[rows, :r_max].clamp(max=t_max - 1)
    sub = ContextBatch(input_ids=ctx.input_ids[rows, :t_max],
                       attention_mask=ctx.attention_mask[rows, :t_max],
                       position_ids=ctx.position_ids[rows, :t_max],
                       labels=ctx.labels[rows, :t_max], gather_index=index,
                       starts=ctx.starts[rows], lengths=ctx.lengths[rows].clamp(max=t_max))
    return sub, targets[rows, :r_max], rows


def stack(a: ContextBatch, b: ContextBatch, pad_id: int) -> ContextBatch:
    """Rows of two right-padded contexts in one batch (padded to the longer)."""
    t = max(a.input_ids.shape[1], b.input_ids.shape[1])

    def pad(x: torch.Tensor, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, t - x.shape[1]), value=value)

    pos = torch.arange(t).expand(a.input_ids.shape[0] + b.input_ids.shape[0], t).clone()
    return ContextBatch(
        input_ids=torch.cat([pad(a.input_ids, pad_id), pad(b.input_ids, pad_id)]),
        attention_mask=torch.cat([pad(a.attention_mask, 0), pad(b.attention_mask, 0)]),
        position_ids=pos, labels=torch.cat([pad(a.labels, -100), pad(b.labels, -100)]),
        gather_index=torch.cat([a.gather_index, b.gather_index]),
        starts=torch.cat([a.starts, b.starts]), lengths=torch.cat([a.lengths, b.lengths]))


def structure(a_full: torch.Tensor, delta: torch.Tensor, valid: torch.Tensor,
              p2: float) -> dict[str, Any]:
    cand = candidate_mask(a_full, valid, p2)
    stops = residual_stops(cand)
    lengths = valid.sum(1)
    scored = valid & (torch.arange(valid.shape[1])[None, :] < stops[:, None])
    ok, undecided = certify_selection(delta, scored, cand, valid, 0.2)
    return {"p2": p2, "rows": int(valid.shape[0]),
            "rows_without_candidate": int((stops == 0).sum()),
            "valid_tokens": int(valid.sum()),
            "slots_after_last_candidate": int((lengths - stops).clamp(min=0).sum()),
            "batch_columns_saved": int(lengths.max() - stops.max()),
            "certificate_holds": ok, "undecided_candidates": undecided}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()

    student, tok = build_model(ModelConfig(name_or_path="saopd:smollm2-135m-instruct",
                                           prune_every=3))
    teacher, _ = build_model(ModelConfig(name_or_path="saopd:smollm2-135m-instruct"))
    teacher.requires_grad_(False)
    records, _ = gsm8k_records(GSM8K_DIR / "train.jsonl")
    recs = random.Random(args.seed).sample(records, args.batch)
    engine = HFGenerateEngine(student, tok)
    t0 = time.perf_counter()
    rollouts = engine.generate([r.messages for r in recs], SamplingParams(
        temperature=1.0, top_p=1.0, max_new_tokens=args.length, seed=args.seed))
    sampling_s = time.perf_counter() - t0
    batch = collate_contexts(tok, rollouts.row_messages(),
                             [r.response_ids for r in rollouts.rollouts],
                             prompt_ids=[r.prompt_ids for r in rollouts.rollouts])
    student.train()
    objective = OBJECTIVES.build("sampled")
    variants = {"vanilla": FILTERS.build("none"), "sa_opd": FILTERS.build("sa_opd")}

    # the batch's signals, once, for the candidate structure
    needs = ScoringNeeds(residual=True)
    with torch.no_grad():
        sig = score_student(batch, score_frozen(batch, student=student, teacher=teacher,
                                                reference=None, needs=needs),
                            student=student, needs=needs)
    valid = batch.response_mask
    shapes = [structure(sig.a_full, sig.grounding_gap, valid, p2) for p2 in (0.3, 0.1)]
    stops = residual_stops(candidate_mask(sig.a_full, valid, 0.3))
    sub, sub_targets, rows = trim(batch.residual, batch.response_ids, stops)
    # the trimmed pass computes the same log-probs on the slots it keeps
    full_lp = lp(teacher, batch.residual, batch.response_ids)
    trim_lp = lp(teacher, sub, sub_targets)
    keep = torch.arange(sub_targets.shape[1])[None, :] < stops[rows][:, None]
    keep &= valid[rows, : sub_targets.shape[1]]
    trim_diff = float((trim_lp - full_lp[rows, : sub_targets.shape[1]])[keep].abs().max())
    both = stack(batch.full, batch.residual, tok.pad_token_id)
    one_lp = lp(teacher, both, torch.cat([batch.response_ids, batch.response_ids]))
    two_lp = torch.cat([lp(teacher, batch.full, batch.response_ids), full_lp])
    vv = torch.cat([valid, valid])
    one_call_diff = float((one_lp - two_lp)[vv].abs().max())

    timers = {
        "vanilla": lambda: step(student, teacher, batch, variants["vanilla"], objective),
        "sa_opd": lambda: step(student, teacher, batch, variants["sa_opd"], objective),
        "sa_opd_stacked": lambda: step(student, teacher, batch, variants["sa_opd"], objective,
                                       stack_teacher=True),
        "residual_full": lambda: timed(lambda: (lp(teacher, batch.residual, batch.response_ids),
                                                lp(student, batch.residual,
                                                   batch.response_ids))),
        "residual_trimmed": lambda: timed(lambda: (lp(teacher, sub, sub_targets),
                                                   lp(student, sub, sub_targets))),
        "teacher_two_calls": lambda: timed(lambda: (lp(teacher, batch.full, batch.response_ids),
                                                    lp(teacher, batch.residual,
                                                       batch.response_ids))),
        "teacher_one_call": lambda: timed(lambda: lp(teacher, both, torch.cat(
            [batch.response_ids, batch.response_ids]))),
    }
    runs: dict[str, list[float]] = {k: [] for k in timers}
    for i in range(args.repeat + 1):
        for name, fn in timers.items():
            s = fn()
            if i:
                runs[name].append(s)
            print(f"round {i} {name:18s} {s:.2f}s", flush=True)
    med = {k: round(statistics.median(v), 3) for k, v in runs.items()}
    van, sa = med["vanilla"], med["sa_opd"]
    report = {
        "benchmark": "residual_savings", "batch": args.batch, "max_new_tokens": args.length,
        "response_tokens": int(valid.sum()), "repeat": args.repeat,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "load_average_start": load_start, "load_average_end": os.getloadavg(),
        "sampling_s": round(sampling_s, 3), "median_s": med,
        "overhead_ratio": round(sa / van, 4),
        "overhead_ratio_stacked_teacher": round(med["sa_opd_stacked"] / van, 4),
        "overhead_ratio_with_sampling": round((sa + sampling_s) / (van + sampling_s), 4),
        "trimmed_sa_opd_ratio_bound": round((sa - med["residual_full"] + med["residual_trimmed"])
                                            / van, 4),
        "residual_trimmed_over_full": round(med["residual_trimmed"] / med["residual_full"], 4),
        "teacher_one_call_over_two": round(med["teacher_one_call"]
                                           / med["teacher_two_calls"], 4),
        "candidate_structure": shapes,
        "max_abs_diff": {"trimmed_vs_full": trim_diff, "one_call_vs_two": one_call_diff},
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
