"""Benchmark: SA-OPD's training-step overhead over vanilla OPD, on the same rollouts, in one run.

One "step" here is everything after sampling: contexts, the frozen passes (teacher full; for
SA-OPD also teacher and student residual), the student's full pass with gradient, filter,
objective, aggregation and backward. Both variants run on the *same* fixed rollout batch,
alternating (vanilla, SA-OPD, vanilla, ...) so that machine drift hits both; the figure is the
ratio of their median step times. Sampling is left out on purpose: it is identical for both
methods (the paper's +2.6% to +7.5% is the overhead of whole steps, sampling included, so this
ratio is an upper bound of that one). Responses are random token ids of a fixed length (their
content does not change the cost of a forward pass).

    .venv/bin/python experiments/benchmarks/step_overhead.py --model smollm2 --length 512
    .venv/bin/python experiments/benchmarks/step_overhead.py --model tiny       # seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from saopd.config.model import ModelConfig
from saopd.contexts.text import collate_contexts
from saopd.filters import FILTERS
from saopd.models.factory import build_model
from saopd.objectives import OBJECTIVES, aggregate
from saopd.scoring.passes import ScoringNeeds, score_frozen, score_student

QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many "
            "clips in May. How many clips did Natalia sell altogether in April and May?")


def one_step(student, teacher, batch, token_filter, objective) -> dict[str, float]:
    """Time the phases of one step; returns seconds per phase."""
    needs = ScoringNeeds.from_fields(token_filter.needs, objective.needs)
    times = {}
    t0 = time.perf_counter()
    frozen = score_frozen(batch, student=student, teacher=teacher, reference=None, needs=needs)
    t1 = time.perf_counter()
    signals = score_student(batch, frozen, student=student, needs=needs)
    result = token_filter(signals)
    loss = aggregate(objective(signals, result).loss, result.keep)
    t2 = time.perf_counter()
    loss.backward()
    student.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    times.update(frozen=t1 - t0, student_forward_filter_loss=t2 - t1, backward=t3 - t2,
                 total=t3 - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--batch", type=int, default=4, help="responses per step")
    parser.add_argument("--length", type=int, default=512, help="response tokens")
    parser.add_argument("--repeat", type=int, default=3, help="steps per variant (+1 warm-up)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    if args.model == "tiny":
        s_cfg = ModelConfig(tiny="qwen3", tiny_layers=2, seed=1)
        t_cfg = ModelConfig(tiny="qwen3", tiny_layers=4, seed=2)
    else:
        s_cfg = ModelConfig(name_or_path="saopd:smollm2-135m-instruct", prune_every=3)
        t_cfg = ModelConfig(name_or_path="saopd:smollm2-135m-instruct")
    student, tok = build_model(s_cfg)
    teacher, _ = build_model(t_cfg)
    student.train()
    teacher.requires_grad_(False)

    g = torch.Generator().manual_seed(0)
    vocab = len(tok)
    responses = [torch.randint(0, vocab, (args.length,), generator=g).tolist()
                 for _ in range(args.batch)]
    messages = [[{"role": "user", "content": QUESTION}]] * args.batch
    batch = collate_contexts(tok, messages, responses)
    objective = OBJECTIVES.build("sampled")
    variants = {"vanilla": FILTERS.build("none"), "sa_opd": FILTERS.build("sa_opd")}

    runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for i in range(args.repeat + 1):
        for name, token_filter in variants.items():
            t = one_step(student, teacher, batch, token_filter, objective)
            if i:  # the first round is a warm-up
                runs[name].append(t)
            print(f"round {i} {name:8s} " + " ".join(f"{k}={v:.2f}s" for k, v in t.items()),
                  flush=True)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    report = {
        "benchmark": "step_overhead", "model": args.model, "batch": args.batch,
        "response_tokens": args.length, "repeat": args.repeat,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "median_s": {name: {k: round(med(name, k), 3) for k in runs[name][0]}
                     for name in variants},
        "overhead_ratio": round(med("sa_opd", "total") / med("vanilla", "total"), 4),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
