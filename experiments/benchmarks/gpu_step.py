"""Benchmark: OPD and SA-OPD training steps at the paper's shapes on one GPU, phase by phase, in
one process; prints one JSON line.

Random-init models of the paper's shapes, built offline straight onto the device in their final
dtype (:func:`saopd.models.loading.init_causal_lm`): the Qwen3-1.7B student (float32 master
weights, its passes under bfloat16 autocast, as ``trainer=gpu``'s ``bf16-mixed``) and the
Qwen3-4B teacher (bfloat16), with the offline Qwen3 tokenizer. Both are loaded once; then
OPD (``filter=none``) and SA-OPD (``filter=sa_opd``, p1 0.2, p2 0.3) take steps in turns
(OPD, SA-OPD, SA-OPD, OPD, ...) on one student and one AdamW (lr 1e-6, clipping 1.0): the cost
of a step does not depend on which method made the last update, and a random-init student's
responses all run to the token limit. A step is what :class:`saopd.lightning.module.OPDModule`
does, without Lightning: per phase (seconds, the device synchronised at each boundary)

- ``rollout``: ``HFGenerateEngine`` on the student (the lean decode loop; ``--static-cache``:
  transformers' static cache with a compiled decode step), temperature 1, top-p 1;
- ``teacher_full``: the teacher's pass over the full contexts;
- ``residual``: the teacher's and the student's residual passes (SA-OPD only);
- ``student_forward_filter_loss``: the student's full pass, the filter, the sampled objective
  and the loss of every micro-batch (``--micro-batch``; with several, a first pass without
  gradient feeds the batch-global filter, as in the module);
- ``backward``, ``optimizer`` (clipping, AdamW, zero_grad); ``contexts`` (building them).

Reported per method: the median of each phase and of the step over the timed steps (the first
step of each method is a warm-up), sampled tokens/s, peak GPU memory, and an MFU estimate of the
scoring passes (teacher full + residual passes: 2 x matrix parameters x positions + attention,
over the bf16 dense peak of the card); then SA-OPD / OPD per whole step, the time from the start
of the process to the first step and the process's host peak RSS against the larger model's
bytes. One step's frozen scores are checked against :func:`saopd.scoring.passes.score_frozen`
(largest difference, reported).

    python experiments/benchmarks/gpu_step.py --out /tmp/gpu_step.json        # a GPU
    python experiments/benchmarks/gpu_step.py --small                         # CPU, seconds

Sizes: 32 prompts x 256 new tokens, micro-batch 8, 10 timed steps per method. At the earlier
measurement's ~21 s per step for 32 x 512 (most of it HF's eager decode, whose cost grows with
the number of tokens, not rows), 22 steps of 32 x 512 would take ~8 min; at 256 new tokens a
step is about half that, so the run fits in about 6 minutes with loading. ``--budget-s`` stops
taking steps (and says so) when the next round would not fit. ``--small`` builds two tiny Qwen3
models (the same code path, CPU, float32, no autocast) for the CI test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from saopd.config.step import StepConfig
from saopd.contexts import TextContexts
from saopd.filters import FILTERS
from saopd.models.loading import init_causal_lm, load_tokenizer
from saopd.objectives import OBJECTIVES, aggregate
from saopd.rollout import HFGenerateEngine, SamplingParams
from saopd.scoring.passes import (
    ScoringNeeds,
    response_source,
    score_frozen,
    score_student,
    score_teacher,
)
from saopd.signals import score_tokens


def process_age() -> float:
    """Seconds since this process started (Linux ``/proc``; 0 elsewhere)."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


#: the process's start on the perf_counter clock (imports included in the time to first step)
STARTED = time.perf_counter() - process_age()

#: Qwen3-1.7B and Qwen3-4B(-Instruct-2507) from their config.json; tiny ones for ``--small``.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3_1p7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "qwen3_4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "small_student": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32),
    "small_teacher": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32),
}
#: Dense bf16 peak of the cards the project is lent, FLOP/s (SXM parts).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12}
PHASES = ("rollout", "contexts", "teacher_full", "residual", "student_forward_filter_loss",
          "backward", "optimizer")
METHODS = ("opd", "sa_opd")
QUESTIONS = ("What is {a} times {b}, plus {c}?", "A shop sells {a} apples a day for {b} days and "
             "then {c} more. How many apples did it sell?",
             "Solve for x: {a}x + {b} = {c}. Give the answer as a fraction.")


def qwen3_config(shape: str, vocab_size: int) -> Any:
    """A Qwen3 config of ``SHAPES[shape]`` (Qwen3's vocabulary rows, tied embeddings)."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=vocab_size, max_position_embeddings=40960,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       bos_token_id=151643, eos_token_id=151645, **SHAPES[shape])


def host_peak_bytes() -> int:
    """This process's high-water RSS (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def prompts(count: int) -> list[list[dict[str, str]]]:
    """``count`` short arithmetic chats (their content does not change a step's cost)."""
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)].format(
        a=7 + i, b=13 + 3 * i, c=101 + 5 * i)}] for i in range(count)]


def matmul_params(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters of the decoder's matrix products, LM-head parameters)."""
    head = model.get_output_embeddings().weight.numel()
    body = sum(p.numel() for name, p in model.named_parameters()
               if p.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name)
    return body, head


def pass_flops(model: torch.nn.Module, rows: int, length: int, response: int) -> float:
    """Forward FLOPs of one scoring pass over ``rows x length`` positions whose last
    ``response`` positions are scored by the head: 2 x matrix parameters per position, causal
    attention (QK^T and AV: 2 x 2 x layers x heads x head_dim x length / 2 per position) and
    the head over the scored positions."""
    cfg = model.config
    body, head = matmul_params(model)
    attn = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * length
    return rows * length * (2 * body + attn) + rows * response * 2 * head


class Timer:
    """Phase times of one step; ``tick`` synchronises the device first."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.last = self.now()

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def tick(self, phase: str) -> None:
        now = self.now()
        self.times[phase] += now - self.last
        self.last = now


def one_step(method: str, ctx_builder: TextContexts, engine: HFGenerateEngine,
             student: torch.nn.Module, teacher: torch.nn.Module, opt: torch.optim.Optimizer,
             chats: list[Any], seed: int, args: argparse.Namespace,
             autocast: Any) -> dict[str, Any]:
    """One step of ``method``; phase seconds, sampled tokens, scoring FLOPs and the frozen
    scores' largest difference from :func:`score_frozen` (when ``args.check``)."""
    token_filter = FILTERS.build("sa_opd", p1=0.2, p2=0.3) if method == "sa_opd" else \
        FILTERS.build("none")
    objective = OBJECTIVES.build("sampled")
    needs = ScoringNeeds.of(token_filter, objective)
    device = next(student.parameters()).device
    timer = Timer(device)
    sampling = SamplingParams(n=1, temperature=1.0, top_p=1.0,
                              max_new_tokens=args.new_tokens, seed=seed)
    started = timer.last
    rollouts = engine.generate(chats, sampling)
    timer.tick("rollout")
    ctx = ctx_builder.collate(rollouts.row_messages(), [r.response_ids for r in rollouts.rollouts],
                              step=StepConfig(), prompt_ids=[r.prompt_ids for r in
                                                             rollouts.rollouts]).to(device)
    timer.tick("contexts")
    vocab = teacher.config.vocab_size
    with autocast():
        scores, _ = score_teacher(ctx, teacher, needs=dataclasses.replace(needs, residual=False),
                                  vocab_size=vocab)
        timer.tick("teacher_full")
        if needs.residual:  # the teacher's residual pass, as score_teacher runs it
            tb = ctx.teacher_view
            scores = dataclasses.replace(scores, lp_teacher_res=score_tokens(
                response_source(teacher, tb.residual, vocab_size=vocab), tb.response_ids
            ).logprobs)
        # the student's residual pass (none for OPD), the teacher's scores given
        frozen = score_frozen(ctx, student=student, teacher=None, reference=None, needs=needs,
                              vocab_size=vocab, teacher_scores=scores)
        timer.tick("residual")
    check, check_s = None, 0.0
    if args.check:
        with autocast():
            whole = score_frozen(ctx, student=student, teacher=teacher, reference=None,
                                 needs=needs, vocab_size=vocab)
        pairs = [(frozen.lp_teacher, whole.lp_teacher),
                 (frozen.lp_teacher_res, whole.lp_teacher_res),
                 (frozen.lp_student_res, whole.lp_student_res)]
        check = max(float((a - b).masked_fill(~ctx.response_mask, 0).abs().max())
                    for a, b in pairs if a is not None)
        now = timer.now()  # the check is not part of the step
        check_s, timer.last = now - timer.last, now
    n_rows = ctx.response_ids.shape[0]
    micro = min(args.micro_batch, n_rows)
    whole_batch = micro >= n_rows
    generator = torch.Generator().manual_seed(seed)
    opt.zero_grad(set_to_none=True)
    with autocast(), torch.set_grad_enabled(whole_batch):
        signals = score_student(ctx, frozen, student=student, needs=needs, vocab_size=vocab)
    result = token_filter(signals, generator=generator)
    out = objective(signals, result)
    num_tokens, num_seqs = result.keep.sum(), (result.keep.sum(-1) > 0).sum()
    for start in range(0, n_rows, micro):
        rows = slice(start, start + micro)
        if whole_batch:
            part, part_loss = result, out.loss
        else:
            with autocast():
                sub = score_student(ctx.rows(rows), frozen.rows(rows), student=student,
                                    needs=needs, vocab_size=vocab)
                part = result.rows(rows)
                part_loss = objective(sub, part).loss
        loss = aggregate(part_loss, part.keep, "token-mean", num_tokens=num_tokens,
                         num_sequences=num_seqs)
        timer.tick("student_forward_filter_loss")
        loss.backward()
        timer.tick("backward")
    torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    timer.tick("optimizer")
    length = ctx.full.input_ids.shape[1]
    flops = pass_flops(teacher, n_rows, length, ctx.response_ids.shape[1])
    if needs.residual:
        res_len = ctx.residual.input_ids.shape[1]
        flops += pass_flops(teacher, n_rows, res_len, ctx.response_ids.shape[1])
        flops += pass_flops(student, n_rows, res_len, ctx.response_ids.shape[1])
    return {"times": timer.times, "step": timer.last - started - check_s, "check_s": check_s,
            "sampled_tokens": sum(len(r.response_ids) for r in rollouts.rollouts),
            "scoring_flops": flops, "frozen_check": check,
            "filtered": int(result.filtered.sum()), "valid": int(signals.num_valid)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes on the CPU (CI)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--tokenizer", default=None,
                    help="a tokenizer folder (default: the offline Qwen3 tokenizer)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per method")
    ap.add_argument("--static-cache", action="store_true",
                    help="rollouts with the static KV cache and a compiled decode step")
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="stop taking steps when the next round would end past this")
    ap.add_argument("--check", action="store_true",
                    help="check every step's frozen scores against score_frozen")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.small:
        args.prompts, args.new_tokens = min(args.prompts, 4), min(args.new_tokens, 8)
        args.micro_batch, args.device = min(args.micro_batch, 2), args.device or "cpu"
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    rss_before = host_peak_bytes()

    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
    else:
        from saopd.models.tokenizers import qwen_tokenizer

        tokenizer = qwen_tokenizer("qwen3")
    loaded = time.perf_counter()
    names = ("small_student", "small_teacher") if args.small else ("qwen3_1p7b", "qwen3_4b")
    vocab = 151936
    student = init_causal_lm(qwen3_config(names[0], vocab), dtype="float32", device=device,
                             seed=1)
    teacher = init_causal_lm(qwen3_config(names[1], vocab),
                             dtype="float32" if args.small else "bfloat16", device=device, seed=2)
    teacher.requires_grad_(False)
    student.train()
    load_s = time.perf_counter() - loaded
    model_bytes = {name: sum(p.numel() * p.element_size() for p in m.parameters())
                   for name, m in (("student", student), ("teacher", teacher))}
    host_after_load = host_peak_bytes()
    use_autocast = device.type == "cuda"

    def autocast() -> Any:
        return torch.autocast("cuda", dtype=torch.bfloat16) if use_autocast else nullcontext()

    engine = HFGenerateEngine(student, tokenizer, static_cache=args.static_cache)
    contexts = TextContexts(tokenizer)
    opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-6)
    chats = prompts(args.prompts)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    peak_mem: dict[str, int] = dict.fromkeys(METHODS, 0)
    first_step_at = None
    rounds = 0
    stopped_early = False
    for i in range(args.steps + 1):
        order = METHODS if i % 2 == 0 else METHODS[::-1]
        for method in order:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            if first_step_at is None:
                first_step_at = time.perf_counter() - STARTED
            outside = time.perf_counter()
            rec = one_step(method, contexts, engine, student, teacher, opt, chats, seed=i,
                           args=args, autocast=autocast)
            rec["wall"] = time.perf_counter() - outside - rec["check_s"]
            if device.type == "cuda":
                peak_mem[method] = max(peak_mem[method], torch.cuda.max_memory_allocated(device))
            rec["round"] = i
            runs[method].append(rec)
            print(f"round {i} {method}: step {rec['step']:.2f} s " + " ".join(
                f"{k}={v:.2f}" for k, v in rec["times"].items()), file=sys.stderr, flush=True)
        rounds = i + 1
        elapsed = time.perf_counter() - STARTED
        per_round = (elapsed - first_step_at) / rounds
        if i < args.steps and elapsed + per_round > args.budget_s:
            stopped_early = True
            break

    cpu = platform.processor() or platform.machine()
    report: dict[str, Any] = {"benchmark": "gpu_step", "small": args.small,
                              "device": torch.cuda.get_device_name(device)
                              if device.type == "cuda" else f"cpu ({cpu}, {os.cpu_count()} cores)",
                              "torch": torch.__version__}
    import transformers

    report["transformers"] = transformers.__version__
    report.update(prompts=args.prompts, new_tokens=args.new_tokens, micro_batch=args.micro_batch,
                  static_cache=args.static_cache, timed_steps=rounds - 1,
                  stopped_early=stopped_early)
    peak = next((v for k, v in PEAK_BF16.items() if k in report["device"]), None)
    methods: dict[str, Any] = {}
    for method in METHODS:
        timed = runs[method][1:] or runs[method]
        phases = {p: statistics.median(r["times"][p] for r in timed) for p in PHASES}
        step = statistics.median(r["step"] for r in timed)
        rollout = sum(r["times"]["rollout"] for r in timed)
        scoring = sum(r["times"]["teacher_full"] + r["times"]["residual"] for r in timed)
        flops = sum(r["scoring_flops"] for r in timed)
        methods[method] = {
            "step_s": step, "phases_s": phases,
            "phases_sum_s": sum(phases.values()),
            "step_times_s": [round(r["step"], 4) for r in runs[method]],
            "wall_step_s": statistics.median(r["wall"] for r in timed),
            "sampled_tokens_per_s": sum(r["sampled_tokens"] for r in timed) / rollout,
            "sampled_tokens_per_step": statistics.median(r["sampled_tokens"] for r in timed),
            "peak_gpu_gib": peak_mem[method] / 2**30 if device.type == "cuda" else None,
            "scoring_tflops_per_s": flops / scoring / 1e12,
            "scoring_mfu": flops / scoring / peak if peak else None,
            "filtered_fraction": sum(r["filtered"] for r in timed) / max(
                1, sum(r["valid"] for r in timed)),
            "frozen_check_max_abs_diff": max((r["frozen_check"] for r in runs[method]
                                              if r["frozen_check"] is not None), default=None),
        }
    report["methods"] = methods
    report["sa_opd_over_opd"] = methods["sa_opd"]["step_s"] / methods["opd"]["step_s"]
    report["residual_share_of_sa_opd_step"] = (methods["sa_opd"]["phases_s"]["residual"]
                                               / methods["sa_opd"]["step_s"])
    larger = max(model_bytes.values())
    report.update(
        model_bytes=model_bytes, load_s=load_s, time_to_first_step_s=first_step_at,
        host_peak_gib_after_load=host_after_load / 2**30,
        host_peak_gib=host_peak_bytes() / 2**30,
        host_peak_growth_over_larger_model=(host_after_load - rss_before) / larger,
        wall_s=time.perf_counter() - STARTED,
        command="experiments/benchmarks/gpu_step.py " + " ".join(sys.argv[1:]))
    line = json.dumps(report)
    print(line, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
