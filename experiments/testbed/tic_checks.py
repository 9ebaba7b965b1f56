"""The tic study's pre-registered checks (a)-(e), each with its number and verdict.

The checks and their bounds were written in ``experiments/testbed/README.md`` ("The tic study:
pre-registration") before any run of a method; this script measures them:

- (a) the **teacher's** prior is input-agnostic: over the 200 held-out problems, with the exact
  worked solution as the response, the wrapped teacher's log-probability of the tic's first
  token at the slot moves by <= 0.05 nats (mean |full - residual|) when the prompt is removed,
  and its probability varies by <= 0.02 (standard deviation over the problems);
- (b) the **student's** log-probability of the same token moves by <= 0.1 nats (mean) without
  the prompt, for the untrained student;
- (c) on 20 real steps of OPD from the prior teacher (seed 0; SA-OPD at p1 = 0 trains exactly as
  vanilla OPD and records A_res), SA-OPD's rule (Eq. 16) at the pre-registered (p1, p2) =
  (0.8, 0.3), re-applied to every step's token records, would remove >= 50% of the tic-slot
  tokens (every position where the prior is in play) and <= 35% of the grounded tokens;
- (d) the harm OPD(clean) - OPD(prior) of the final held-out Avg@4, mean over seeds 0 and 1,
  is >= 0.10;
- (e) the slot oracle recovers >= 50% of that harm (mean over the same seeds).

    .venv/bin/python experiments/testbed/tic_checks.py            # (a)-(e), about 15 minutes
    .venv/bin/python experiments/testbed/tic_checks.py --only ab  # the offline checks only

The runs of (c)-(e) go to ``outputs/tic_checks/`` (``logger=none``); the numbers and verdicts to
``experiments/testbed/results/tic/checks.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
OUT = REPO / "experiments" / "testbed" / "results" / "tic"
RUNS = REPO / "outputs" / "tic_checks"
TASK = REPO / "data" / "prepared" / "testbed_tic"
EXPERIMENT = "testbed_tic"
ACCURACY = "eval/arith_tic/avg_at_4"
#: The pre-registered SA-OPD ratios and the checks' bounds (README, "pre-registration").
P1, P2 = 0.8, 0.3
BOUNDS = {"a_shift": 0.05, "a_sd": 0.02, "b_shift": 0.1, "c_slot": 0.5, "c_grounded": 0.35,
          "d_harm": 0.10, "e_recovered": 0.5}


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def onset_logprobs(model_dir: Path, rate: float | None, limit: int = 200
                   ) -> tuple[list[float], list[float]]:
    """log P(tic's first token at the slot) per held-out problem, with the prompt (full context)
    and without it (the residual context, as training builds it); ``rate``: wrap the model as
    the tic teacher at this rate (None: the model as it is)."""
    import torch

    from saopd.config.model import ModelConfig, TicConfig
    from saopd.contexts.text import collate_contexts
    from saopd.filters.oracle import tic_token_ids
    from saopd.models.factory import build_model
    from saopd.scoring.passes import response_source
    from saopd.signals import score_tokens
    from saopd.stages.testbed import Problem, solution_text
    from saopd.testbeds.arithmetic import load_tic

    text = load_tic(TASK / "task.json")
    assert text is not None
    cfg = ModelConfig(name_or_path=str(model_dir),
                      tic=None if rate is None else TicConfig(rate=rate, text=text))
    model, tok = build_model(cfg)
    end, tic = tic_token_ids(tok, text, "}.")
    rows = [json.loads(line) for line in (TASK / "test.jsonl").read_text().splitlines()][:limit]
    full, res = [], []
    with torch.no_grad():
        for lo in range(0, len(rows), 50):
            chunk = rows[lo:lo + 50]
            answers = [tok(solution_text(Problem(r["metadata"]["a"], r["metadata"]["b"])),
                           add_special_tokens=False)["input_ids"] for r in chunk]
            assert all(a[-1] == end for a in answers)
            batch = collate_contexts(tok, [r["messages"] for r in chunk],
                                     [a + tic for a in answers])
            for ctx, out in ((batch.full, full), (batch.residual, res)):
                lp = score_tokens(response_source(model, ctx), batch.response_ids).logprobs
                out.extend(float(lp[i, len(a)]) for i, a in enumerate(answers))
    return full, res


def check_ab(results: dict[str, Any]) -> None:
    import math

    teacher = REPO / "data" / "models" / "testbed_tic" / "teacher"
    student = REPO / "data" / "models" / "testbed_tic" / "student"
    full, res = onset_logprobs(teacher, rate=0.3)
    shift = [abs(a - b) for a, b in zip(full, res, strict=True)]
    probs = [math.exp(a) for a in full]
    a = {"mean_shift": statistics.fmean(shift), "max_shift": max(shift),
         "mean_p": statistics.fmean(probs), "sd_p": statistics.pstdev(probs),
         "problems": len(full)}
    a["pass"] = a["mean_shift"] <= BOUNDS["a_shift"] and a["sd_p"] <= BOUNDS["a_sd"]
    results["a"] = a
    print(f"(a) teacher: mean |log P'(onset|x) - log P'(onset|no prompt)| = {a['mean_shift']:.4f} "
          f"nats (max {a['max_shift']:.4f}; bound {BOUNDS['a_shift']}); P'(onset|x) = "
          f"{a['mean_p']:.4f}, SD over {a['problems']} problems {a['sd_p']:.4f} "
          f"(bound {BOUNDS['a_sd']}): {_verdict(a['pass'])}", flush=True)
    full, res = onset_logprobs(student, rate=None)
    shift = [abs(x - y) for x, y in zip(full, res, strict=True)]
    b = {"mean_shift": statistics.fmean(shift), "max_shift": max(shift),
         "mean_p_full": statistics.fmean(math.exp(x) for x in full),
         "mean_p_residual": statistics.fmean(math.exp(x) for x in res)}
    b["pass"] = b["mean_shift"] <= BOUNDS["b_shift"]
    results["b"] = b
    print(f"(b) student (untrained): mean |log P_S(onset|x) - log P_S(onset|no prompt)| = "
          f"{b['mean_shift']:.4f} nats (max {b['max_shift']:.4f}; bound {BOUNDS['b_shift']}); "
          f"P_S(onset) {b['mean_p_full']:.4f} with the prompt, {b['mean_p_residual']:.4f} "
          f"without: {_verdict(b['pass'])}", flush=True)


def train_run(name: str, *overrides: str) -> dict[str, Any]:
    """One saopd-train run (no MLflow) into ``outputs/tic_checks/<name>``; its summary."""
    folder = RUNS / name
    summary = folder / "summary.json"
    if summary.is_file():
        return dict(json.loads(summary.read_text()))
    cmd = [str(BIN / "saopd-train"), f"experiment={EXPERIMENT}", "logger=none",
           f"hydra.run.dir={folder}", *overrides]
    print("+", " ".join(cmd), flush=True)
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
    with open(RUNS / f"{name}.log", "w") as log:
        subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=log, stderr=subprocess.STDOUT)
    return dict(json.loads(summary.read_text()))


def check_c(results: dict[str, Any]) -> None:
    from saopd.filters.oracle import tic_token_ids
    from saopd.models.tiny import tiny_tokenizer
    from saopd.testbeds.arithmetic import (
        TicTruth,
        load_habits,
        load_tic,
        read_token_records,
        selection_at_ratios,
    )

    summary = train_run("c_opd_prior_s0", "method=sa_opd", "filter.p1=0.0", "steps=20",
                        "trainer.view_every_n_steps=1", "eval.every_n_steps=0",
                        "eval.at_start=false", "seed=0")
    records = read_token_records(Path(summary["output_dir"]) / "token_records")
    text = load_tic(TASK / "task.json")
    assert text is not None
    end, ids = tic_token_ids(tiny_tokenizer(), text, "}.")
    truth = TicTruth(end, tuple(ids))
    counts = selection_at_ratios(records, load_habits(TASK / "task.json"), [(P1, P2)],
                                 tic=truth)[(P1, P2)]
    slot_v = counts.valid["tic"] + counts.valid["tic_slot"]
    slot_f = counts.filtered["tic"] + counts.filtered["tic_slot"]
    s = counts.summary()
    c = {"steps": len(records), "tic_slot_tokens": slot_v,
         "p_filtered_tic_slot": slot_f / slot_v if slot_v else float("nan"),
         "p_filtered_tic": s["p_filtered_tic"], "p_filtered_slot_not_tic":
         s["p_filtered_tic_slot"], "p_filtered_grounded": s["p_filtered_grounded"],
         "filtered_share": s["filtered_share"], "tic_tokens": counts.valid["tic"],
         "gap_tic": s["gap_tic"], "gap_grounded": s["gap_grounded"],
         "abs_a_tic": s["abs_a_tic"], "abs_a_tic_slot": s["abs_a_tic_slot"],
         "abs_a_grounded": s["abs_a_grounded"]}
    c["pass"] = (c["p_filtered_tic_slot"] >= BOUNDS["c_slot"]
                 and c["p_filtered_grounded"] <= BOUNDS["c_grounded"])
    results["c"] = c
    print(f"(c) SA-OPD at (p1, p2) = ({P1}, {P2}) on {c['steps']} steps of OPD(prior): removes "
          f"{c['p_filtered_tic_slot']:.3f} of the {slot_v} tic-slot tokens (bound >= "
          f"{BOUNDS['c_slot']}; tic tokens {c['p_filtered_tic']:.3f}, the slot's other tokens "
          f"{c['p_filtered_slot_not_tic']:.3f}) and {c['p_filtered_grounded']:.3f} of the "
          f"grounded tokens (bound <= {BOUNDS['c_grounded']}): {_verdict(c['pass'])}",
          flush=True)


def check_de(results: dict[str, Any]) -> None:
    arms = {"clean": ["method=opd", "model@teacher=testbed_tic_teacher"],
            "prior": ["method=opd"], "oracle_slot": ["method=oracle_slot"]}
    # the experiment's run design (conf/experiment/testbed_tic.yaml: steps and evaluation)
    jobs = [(f"{arm}_s{seed}", [*over, f"seed={seed}"])
            for seed in (0, 1) for arm, over in arms.items()]
    with ThreadPoolExecutor(2) as pool:
        done = dict(zip([n for n, _ in jobs],
                        pool.map(lambda j: train_run(j[0], *j[1]), jobs), strict=True))

    def final(name: str) -> float:
        ev = done[name]["eval"]
        return float(ev[max(ev, key=int)][ACCURACY])

    harm = [final(f"clean_s{s}") - final(f"prior_s{s}") for s in (0, 1)]
    rec = [final(f"oracle_slot_s{s}") - final(f"prior_s{s}") for s in (0, 1)]
    d = {"harm_per_seed": harm, "mean_harm": statistics.fmean(harm),
         "final": {n: final(n) for n in done}}
    d["pass"] = d["mean_harm"] >= BOUNDS["d_harm"]
    share = statistics.fmean(rec) / d["mean_harm"] if d["mean_harm"] > 0 else float("nan")
    e = {"recovered_per_seed": rec, "mean_recovered": statistics.fmean(rec), "share": share}
    e["pass"] = share >= BOUNDS["e_recovered"]
    results["d"], results["e"] = d, e
    print(f"(d) harm OPD(clean) - OPD(prior), final Avg@4: seeds 0, 1: "
          f"{harm[0]:+.4f}, {harm[1]:+.4f}; mean {d['mean_harm']:+.4f} (bound >= "
          f"{BOUNDS['d_harm']}): {_verdict(d['pass'])}", flush=True)
    print(f"(e) slot oracle - OPD(prior): {rec[0]:+.4f}, {rec[1]:+.4f}; recovers {share:.2f} "
          f"of the harm (bound >= {BOUNDS['e_recovered']}): {_verdict(e['pass'])}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="abcde", help="which checks, e.g. ab or c")
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    RUNS.mkdir(parents=True, exist_ok=True)
    path = OUT / "checks.json"
    results: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    if set("ab") & set(args.only):
        check_ab(results)
    if "c" in args.only:
        check_c(results)
    if set("de") & set(args.only):
        check_de(results)
    results["bounds"] = BOUNDS
    path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
