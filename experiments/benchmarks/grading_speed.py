"""Benchmark: grade 10,000 math responses with ``grade_many`` (goal: < 60 s on 2 CPU cores).

Responses are built from real golds: MATH500 (its reference solution as the chain of thought, the
final box holding either the gold or a wrong answer) and GSM8K test (its rationale, then the answer
as ``\\boxed{}``, ``#### n`` or "The answer is n."). Half are correct, half wrong; wrong answers are
either a near miss (a number off by one or ten times too big, a sign flip) or another problem's
gold. Correct ones are sometimes respelled (``\\dfrac``, thousands separators, ``\\text{}`` units).
Every response starts with ~1,500 characters of exploratory reasoning (other MATH500 solutions
with their boxes removed), so that responses average about 2,000 characters.
Reports wall time (process start-up included), responses/s, the accuracy (expected 0.5), how
often the grade agrees with the construction label, and the number of timeouts, as JSON.

    .venv/bin/python experiments/benchmarks/grading_speed.py [--n 10000] [--workers 2] [--out F]
        [--timeout 5] [--scratch-chars 1500]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import time
from pathlib import Path

from saopd.eval.grading import grade_many_detailed
from saopd.eval.math import extract_answer, normalize_answer

DATA = Path(os.environ.get("SAOPD_SHARED_DATA", "/work/shared/data"))
MATH500 = DATA / "hkust-nlp/simpleRL-reason/examples/simplelr_math_eval/data/math500/test.jsonl"
GSM8K = DATA / "openai/grade-school-math/grade_school_math/data/test.jsonl"


def _rows(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f]


def _near_miss(gold: str, rng: random.Random) -> str | None:
    """A wrong answer that looks close to a numeric gold, or None for non-numeric golds."""
    norm = normalize_answer(gold)
    if not re.fullmatch(r"-?\d+", norm):
        return None
    value = int(norm)
    return str(rng.choice([value + 1, value - 1, value * 10 + 1, -value - 1]))


def _respell(answer: str, rng: random.Random) -> str:
    """The same answer written differently (what models do)."""
    if re.fullmatch(r"\d{4,}", answer) and rng.random() < 0.5:
        return f"{int(answer):,}"
    if "\\frac" in answer and rng.random() < 0.5:
        return answer.replace("\\frac", "\\dfrac")
    if re.fullmatch(r"\d+", answer) and rng.random() < 0.2:
        return answer + "\\text{ units}"
    return answer


def _wrong_other(gold: str, pool: list[str], rng: random.Random) -> str:
    """Another problem's gold that differs from ``gold`` after normalisation."""
    def key(answer: str) -> str:  # "x=5" is "5"; "1,-2" is "-2,1"
        norm = re.sub(r"^[A-Za-z]\s*=\s*", "", normalize_answer(answer)).lstrip("0")
        return ",".join(sorted(part.strip() for part in norm.split(",")))

    while True:
        other = rng.choice(pool)
        if key(other) != key(gold):
            return other


def _scratch_work(solutions: list[str], rng: random.Random, chars: int) -> str:
    """About ``chars`` characters of exploratory reasoning (other solutions, boxes removed)."""
    parts: list[str] = []
    while sum(len(p) for p in parts) < chars:
        text = re.sub(r"\\(?:boxed|fbox)", "", rng.choice(solutions))
        parts.append("Let me try another approach first. " + text)
    return "\n\n".join(parts)[:chars] + "\n\nWait, let me solve the actual problem.\n\n"


def build(n: int, seed: int = 0, scratch_chars: int = 1500
          ) -> tuple[list[tuple[str, str]], list[bool]]:
    """``n`` (response, gold) pairs, half MATH500 and half GSM8K, alternating correct/wrong.

    Each response starts with ``scratch_chars`` characters of exploratory reasoning, so that
    lengths are closer to real model outputs than the reference solutions alone.
    """
    rng = random.Random(seed)
    math_rows = _rows(MATH500)
    gsm_rows = _rows(GSM8K)
    solutions = [r["solution"] for r in math_rows]
    math_golds = [r["answer"] for r in math_rows]
    gsm_golds = [r["answer"].split("####")[-1].strip() for r in gsm_rows]
    pairs: list[tuple[str, str]] = []
    labels: list[bool] = []
    for i in range(n):
        correct = i % 2 == 0
        if (i // 2) % 2 == 0:  # MATH500: reference solution as chain of thought
            row = math_rows[(i // 4) % len(math_rows)]
            gold = row["answer"]
            if correct:
                answer = _respell(gold, rng)
            else:
                answer = _near_miss(gold, rng) or _wrong_other(gold, math_golds, rng)
            solution = row["solution"]
            box = solution.rfind("\\boxed")
            cot = solution[:box] if box != -1 else solution
            response = f"{cot}\\boxed{{{answer}}}$.\n\nThe final answer is $\\boxed{{{answer}}}$."
        else:  # GSM8K: rationale, then one of three answer formats
            row = gsm_rows[(i // 4) % len(gsm_rows)]
            rationale, gold = row["answer"].rsplit("####", 1)
            gold = gold.strip()
            rationale = re.sub(r"<<[^>]*>>", "", rationale).strip()
            answer = (_respell(gold, rng) if correct
                      else _near_miss(gold, rng) or _wrong_other(gold, gsm_golds, rng))
            ending = rng.choice([f"\\boxed{{{answer}}}", f"#### {answer}",
                                 f"The answer is {answer}."])
            response = f"Let's think step by step.\n{rationale}\n{ending}"
        pairs.append((_scratch_work(solutions, rng, scratch_chars) + response, gold))
        labels.append(correct)
    return pairs, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=5.0, help="per-response limit (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scratch-chars", type=int, default=1500,
                        help="exploratory reasoning prepended to every response")
    parser.add_argument("--out", type=str, default=None, help="also write the JSON here")
    args = parser.parse_args()

    pairs, labels = build(args.n, args.seed, args.scratch_chars)
    start = time.perf_counter()
    results = grade_many_detailed(pairs, workers=args.workers, timeout_s=args.timeout)
    seconds = time.perf_counter() - start
    correct = [r.correct for r in results]
    disagreements = [i for i, (c, y) in enumerate(zip(correct, labels, strict=True)) if c != y]
    report = {
        "benchmark": "grading_speed",
        "responses": len(pairs),
        "workers": args.workers,
        "seconds": round(seconds, 2),
        "responses_per_s": round(len(pairs) / seconds, 1),
        "accuracy": round(sum(correct) / len(correct), 4),
        "expected_accuracy": 0.5,
        "label_agreement": round(1 - len(disagreements) / len(pairs), 4),
        "timeouts": sum(r.timed_out for r in results),
        "mean_response_chars": round(sum(len(r) for r, _ in pairs) / len(pairs)),
        "disagreement_examples": [
            {"gold": pairs[i][1], "extracted": extract_answer(pairs[i][0]), "label": labels[i]}
            for i in disagreements[:10]
        ],
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "goal": "< 60 s on 2 cores",
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
