"""Benchmark: one step of the arithmetic testbed (``experiment=testbed``), phase by phase, with
the speed-ups of issue 26 off ("before") and on ("after"), alternating in one process.

A step is what :class:`~saopd.lightning.module.OPDModule` does, without Lightning and MLflow:
64 held-in prompts (the next 64 rows of ``train.jsonl`` each step), one sample each, up to 64
new tokens, temperature 1 and top-p 1, seeded per step (``rollout``); the contexts (``contexts``);
the teacher's full and residual passes and the student's residual pass (``frozen``); the
student's full pass with gradient, SA-OPD's filter (p1 0.2, p2 0.3), the sampled objective,
backward and AdamW (``student``). ``eval``: one evaluation as the testbed's (200 held-out
``arith`` problems x 4 samples, 8 problems per ``generate`` call, 64 new tokens), sampling and
grading (in this process, ``grade_workers=0``) timed apart.

The two variants start from the same student weights and take the same steps, in turns
(before, after, before, ...), so load drift hits both. "before": HF ``generate`` for every
rollout (``HFGenerateEngine(lean_decode=False)``) and one padded forward with the mask per pass
(``saopd.scoring.passes.MAX_LENGTH_BUCKETS = 0``); "after": the lean decode loop and
``MAX_LENGTH_BUCKETS = --buckets`` (1, the default: no padding mask, bit-identical; 4: length
buckets, float rounding). For every step the script checks that both variants sampled the same
tokens with the same sampler log-probs (bit for bit) and reports the largest difference of the
teacher's log-probs and both losses. A third variant, ``fast``, is the testbed's fast mode,
which changes the random stream (compared over seeds in docs/benchmarks.md, not here):
``rollout.sampler=inverse_cdf`` (one uniform per row instead of ``torch.multinomial``, whose
CPU kernel draws one exponential per vocabulary entry; :mod:`saopd.rollout.sampling`), and the
evaluation with ``eval.sampler=inverse_cdf eval.batch_size=200`` (all 200 problems per call
instead of 8).

    .venv/bin/python experiments/benchmarks/testbed_step.py --steps 6 --evals 2 \\
        --out docs/figures/testbed_step.json

One torch thread (``trainer.threads: 1``). Reports JSON: per phase and variant the median
seconds over the steps after the first, their ratios, the equality checks, the load average
before and after.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from saopd.config.step import StepConfig
from saopd.contexts import TextContexts
from saopd.eval.runner import evaluate_benchmark, load_benchmark
from saopd.filters import FILTERS
from saopd.models.loading import load_causal_lm, load_tokenizer
from saopd.objectives import OBJECTIVES, aggregate
from saopd.rollout import HFGenerateEngine, SamplingParams
from saopd.scoring import passes
from saopd.scoring.passes import ScoringNeeds, score_frozen, score_student

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("before", "after", "fast")
AFTER_BUCKETS = 1  # saopd.scoring.passes.MAX_LENGTH_BUCKETS of "after" and "fast" (--buckets)
#: Problems per ``generate`` call of each variant's evaluation (``eval.batch_size``).
EVAL_BATCH = {"before": 8, "after": 8, "fast": 200}


def _load_prompts(path: Path, count: int) -> list[list[dict[str, str]]]:
    with path.open() as f:
        rows = [json.loads(line) for _, line in zip(range(count), f, strict=False)]
    return [row["messages"] for row in rows]


def _set_variant(name: str) -> None:
    """The scoring passes' switch (the engine's are its ``lean_decode`` and ``sampler``)."""
    passes.MAX_LENGTH_BUCKETS = 0 if name == "before" else AFTER_BUCKETS


class Run:
    """One variant's student, optimizer and rollout engine (the teacher is shared, frozen)."""

    def __init__(self, name: str, student: torch.nn.Module, tokenizer: Any, lr: float) -> None:
        self.name = name
        self.student = copy.deepcopy(student)
        self.engine = HFGenerateEngine(self.student, tokenizer, lean_decode=name != "before",
                                       sampler="inverse_cdf" if name == "fast" else "multinomial")
        self.opt = torch.optim.AdamW(self.student.parameters(), lr=lr)
        self.times: dict[str, list[float]] = {}

    def tick(self, phase: str, started: float) -> float:
        now = time.perf_counter()
        self.times.setdefault(phase, []).append(now - started)
        return now


def _step(run: Run, teacher: torch.nn.Module, contexts: TextContexts, chats: list[Any],
          seed: int, token_filter: Any, objective: Any, needs: ScoringNeeds) -> dict[str, Any]:
    """One training step of ``run``; returns what the variants are compared on."""
    _set_variant(run.name)
    sampling = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_new_tokens=64, seed=seed)
    t = time.perf_counter()
    rollouts = run.engine.generate(chats, sampling)
    t = run.tick("rollout", t)
    ctx = contexts.collate(rollouts.row_messages(), [r.response_ids for r in rollouts.rollouts],
                           step=StepConfig(), prompt_ids=[r.prompt_ids for r in rollouts.rollouts])
    t = run.tick("contexts", t)
    frozen = score_frozen(ctx, student=run.student, teacher=teacher, reference=None, needs=needs)
    t = run.tick("frozen", t)
    run.opt.zero_grad(set_to_none=True)
    signals = score_student(ctx, frozen, student=run.student, needs=needs)
    result = token_filter(signals, generator=torch.Generator().manual_seed(seed))
    out = objective(signals, result)
    keep = result.keep
    loss = aggregate(out.loss, keep, "token-mean", num_tokens=keep.sum(),
                     num_sequences=(keep.sum(-1) > 0).sum())
    loss.backward()
    run.opt.step()
    run.tick("student", t)
    return {"tokens": [r.response_ids for r in rollouts.rollouts],
            "logprobs": [r.sampler_logprobs for r in rollouts.rollouts],
            "lp_teacher": frozen.lp_teacher.masked_fill(~ctx.response_mask, 0),
            "loss": float(loss.detach())}


def _evaluate(run: Run, tokenizer: Any, problems: list[Any]) -> dict[str, Any]:
    _set_variant(run.name)
    sampling = SamplingParams(n=4, temperature=1.0, top_p=1.0, max_new_tokens=64, seed=0)
    timed: dict[str, float] = {}
    real_generate = run.engine.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        out = real_generate(*args, **kwargs)
        timed["sampling"] = timed.get("sampling", 0.0) + time.perf_counter() - started
        return out

    run.engine.generate = generate  # type: ignore[method-assign]
    started = time.perf_counter()
    try:
        res = evaluate_benchmark("arith", problems, run.engine, tokenizer, sampling,
                                 batch_size=EVAL_BATCH[run.name], grade_workers=0)
    finally:
        del run.engine.generate
    total = time.perf_counter() - started
    run.times.setdefault("eval", []).append(total)
    run.times.setdefault("eval_sampling", []).append(timed["sampling"])
    return {"score": res.score, "responses": [s["response"] for s in res.samples]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=str(ROOT / "data/models/testbed"),
                    help="folder with student/ and teacher/")
    ap.add_argument("--prompts", default=str(ROOT / "data/prepared/testbed/train.jsonl"))
    ap.add_argument("--eval-dir", default=str(ROOT / "data/prepared/eval"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--evals", type=int, default=2)
    ap.add_argument("--buckets", type=int, default=1,
                    help="MAX_LENGTH_BUCKETS of the 'after' variant (1: the default, exact)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    global AFTER_BUCKETS
    AFTER_BUCKETS = args.buckets
    torch.set_num_threads(1)
    load_before = os.getloadavg()

    models = Path(args.models)
    tokenizer = load_tokenizer(str(models / "student"))
    student = load_causal_lm(str(models / "student"), dtype="float32")
    teacher = load_causal_lm(str(models / "teacher"), dtype="float32").eval()
    teacher.requires_grad_(False)
    contexts = TextContexts(tokenizer)
    token_filter = FILTERS.build("sa_opd", p1=0.2, p2=0.3)
    objective = OBJECTIVES.build("sampled")
    needs = ScoringNeeds.of(token_filter, objective)
    prompts = _load_prompts(Path(args.prompts), 64 * args.steps)
    runs = {name: Run(name, student, tokenizer, lr=3e-4) for name in VARIANTS}

    checks: list[dict[str, Any]] = []
    for step in range(args.steps):
        chats = prompts[64 * step:64 * (step + 1)]
        out = {name: _step(runs[name], teacher, contexts, chats, step, token_filter, objective,
                           needs) for name in (VARIANTS if step % 2 == 0 else VARIANTS[::-1])}
        _set_variant("after")
        before, after = out["before"], out["after"]
        checks.append({
            "step": step,
            "same_tokens": before["tokens"] == after["tokens"],
            "same_sampler_logprobs": before["logprobs"] == after["logprobs"],
            "lp_teacher_max_abs_diff": float((before["lp_teacher"] - after["lp_teacher"]).abs()
                                             .max()) if before["tokens"] == after["tokens"]
            else None,
            "loss": [before["loss"], after["loss"]],
        })
        print(json.dumps(checks[-1]), flush=True)

    problems = load_benchmark("arith", args.eval_dir, limit=200)
    evals = []
    for i in range(args.evals):
        res = {name: _evaluate(runs[name], tokenizer, problems)
               for name in (VARIANTS if i % 2 == 0 else VARIANTS[::-1])}
        _set_variant("after")
        evals.append({"scores": [res[n]["score"] for n in VARIANTS],
                      "same_responses": res["before"]["responses"] == res["after"]["responses"]})
        print(json.dumps(evals[-1]), flush=True)

    phases: dict[str, dict[str, float]] = {}
    for phase in runs["before"].times:
        med = {}
        for name in VARIANTS:
            values = runs[name].times[phase]
            values = values[1:] if phase not in ("eval", "eval_sampling") and len(values) > 1 \
                else values
            med[name] = statistics.median(values)
        med["ratio"] = med["before"] / med["after"]
        med["ratio_fast"] = med["before"] / med["fast"]
        phases[phase] = med
    step_phases = ("rollout", "contexts", "frozen", "student")
    totals = {name: sum(phases[p][name] for p in step_phases) for name in VARIANTS}
    amortised = {name: totals[name] + phases["eval"][name] / 25 for name in VARIANTS}
    report = {
        "phases_median_s": phases,
        "step_s": totals, "step_ratio": totals["before"] / totals["after"],
        "step_ratio_fast": totals["before"] / totals["fast"],
        "step_with_eval_every_25_s": amortised,
        "checks": checks, "evals": evals,
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "command": "experiments/benchmarks/testbed_step.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
            if k in ("steps", "evals", "buckets")),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
