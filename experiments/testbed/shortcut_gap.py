"""Where the shortcut study's grounding gap comes from: the teacher or the student.

For each of the 200 held-out problems of the first testbed, with the shortcut answer line
(``So the answer is \\boxed{n}.``) as the response, the log-probability of its decision token
``So`` at the first response position with the prompt (full context) and without it (the
residual context, as training builds it), for the teacher with the prior and for the student
(the untrained one, or a trained checkpoint's student with ``--checkpoint``). The paper's gap
|A_full - A_res| at that token is |(lp_S - lp_T)_full - (lp_S - lp_T)_res|: this splits it into
the two models' own moves.

    .venv/bin/python experiments/testbed/shortcut_gap.py
    .venv/bin/python experiments/testbed/shortcut_gap.py --checkpoint outputs/.../last.ckpt
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data" / "prepared" / "testbed"
MODELS = REPO / "data" / "models" / "testbed"


def so_logprobs(model: Any, tok: Any, rows: list[dict[str, Any]]
                ) -> tuple[list[float], list[float]]:
    """log P(So | context) at the first response position, full and residual, per row."""
    import torch

    from saopd.contexts.text import collate_contexts
    from saopd.scoring.passes import response_source
    from saopd.signals import score_tokens
    from saopd.stages.testbed import Problem, solution_text

    full, res = [], []
    with torch.no_grad():
        for lo in range(0, len(rows), 50):
            chunk = rows[lo:lo + 50]
            responses = [tok(solution_text(Problem(r["metadata"]["a"], r["metadata"]["b"]),
                                           worked=False), add_special_tokens=False)["input_ids"]
                         for r in chunk]
            batch = collate_contexts(tok, [r["messages"] for r in chunk], responses)
            for ctx, out in ((batch.full, full), (batch.residual, res)):
                lp = score_tokens(response_source(model, ctx), batch.response_ids).logprobs
                out.extend(float(lp[i, 0]) for i in range(len(chunk)))
    return full, res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=None, help="a run's last.ckpt: score its student")
    args = ap.parse_args(argv)
    import torch

    from saopd.models.loading import load_causal_lm, load_tokenizer

    torch.set_num_threads(1)
    rows = [json.loads(x) for x in (DATA / "test.jsonl").read_text().splitlines() if x.strip()]
    out = {}
    for label, folder in (("teacher with the prior", "teacher_prior"), ("student", "student")):
        model = load_causal_lm(str(MODELS / folder), dtype="float32").eval()
        tok = load_tokenizer(str(MODELS / folder))
        if folder == "student" and args.checkpoint:
            state = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
            weights = {k.removeprefix("student."): v for k, v in state["state_dict"].items()
                       if k.startswith("student.")}
            model.load_state_dict(weights)
            label = f"student ({Path(args.checkpoint).parent.parent.name})"
        full, res = so_logprobs(model, tok, rows)
        shift = [abs(a - b) for a, b in zip(full, res, strict=True)]
        probs = [math.exp(a) for a in full]
        out[label] = {"mean_shift": statistics.fmean(shift),
                      "mean_p_full": statistics.fmean(probs), "sd_p_full": statistics.pstdev(probs),
                      "mean_p_residual": statistics.fmean(math.exp(b) for b in res)}
        print(f"{label}: mean |log P(So|x) - log P(So|no prompt)| = {out[label]['mean_shift']:.3f}"
              f" nats; P(So|x) = {out[label]['mean_p_full']:.3f} (SD over {len(rows)} problems "
              f"{out[label]['sd_p_full']:.3f}); P(So|no prompt) = "
              f"{out[label]['mean_p_residual']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
