"""The planted-prior testbed: does SA-OPD filter a teacher's input-agnostic prior, and does the
student then inherit less of it? (issue 8; ``README.md`` beside this file has the results)

Teacher: SmolLM2-135M-Instruct wrapped in :class:`saopd.testbeds.planted.PlantedPriorLM` (config
``conf/model/smollm2_135m_instruct_planted.yaml``): +``spurious_bonus`` nats on 17 template
tokens ("So", " Therefore", " Let", " step", ...) in every context, +``grounded_bonus`` on the
tokens of the row's prompt. Student: its 10-layer pruned copy. Three phases, one command::

    .venv/bin/python experiments/archive/planted_prior/run.py  # archived: no Make target

1. ``rates``: per seed, the student samples responses to GSM8K train prompts; the teacher (full
   and residual) and the student score them once; SA-OPD and the three calibrated ablations
   (``match_sa_opd``: the same number of tokens as SA-OPD on the same batch) filter the same
   signals. Each position is classed by the *source* of its signal: the contributions of the
   spurious prior and of the grounded bias to A_full, dA_s and dA_g, each measured with a
   teacher carrying that bias alone (:func:`bias_contributions`); ``spurious`` where |dA_s| >=
   ``--signal-threshold`` and > |dA_g|, ``grounded`` where |dA_g| >= the threshold and >=
   |dA_s|, else ``weak``. Reported per method: P(filtered | class), and the share of the planted
   signal on the filtered tokens that the spurious prior made, sum_F |dA_s| / sum_F (|dA_s| +
   |dA_g|); mean and 95% CI over seeds. (Classes by the sampled token's identity, template or
   prompt token, are in the JSON too.)
2. ``train``: per method (vanilla OPD = ``filter=none``, ``sa_opd``, ``divergence_only``,
   ``ig_only``, ``random``) and seed, ``saopd-train`` (in process, the ``smollm2_gsm8k``
   experiment with the planted teacher) for ``--steps`` steps.
3. ``eval`` (at the end of each run, and once for the untrained student): the student samples
   one response (temperature 1.0, top-p 1.0, the training sampler) to each of a fixed subset of
   GSM8K test problems; reported: template-token rate (share of response tokens in the spurious
   set), prompt-copy rate (share of response tokens that occur in the prompt), GSM8K accuracy
   (Avg@1, graded by saopd.eval.math), and per method the paired difference from vanilla OPD
   (same seed, same prompts and sampler seed), mean and 95% CI.

Outputs under ``--out`` (default ``experiments/archive/planted_prior/results``):
``results.json`` and
``filter_rates.png``, ``inheritance.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lightning as L
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
METHODS = ("none", "sa_opd", "divergence_only", "ig_only", "random")
FILTERS = ("sa_opd", "divergence_only", "ig_only", "random")
SOURCE_CLASSES = ("spurious", "grounded", "weak")
SOURCE_LABELS = {"spurious": "signal mostly from the spurious prior",
                 "grounded": "signal mostly from the grounded bias",
                 "weak": "weak planted signal"}
EVAL_KEYS = ("template_mass", "template_rate", "prompt_mass", "prompt_copy_rate", "accuracy")
STUDENT_CONFIGS = {"full": "smollm2_135m_instruct", "pruned": "smollm2_135m_instruct_pruned"}
# two-sided 95% Student-t quantiles, by degrees of freedom
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228}


def mean_ci(values: list[float]) -> dict[str, float]:
    """Mean and the half-width of its 95% Student-t confidence interval (n >= 2)."""
    n = len(values)
    if n == 0:
        return {"mean": float("nan"), "ci95": float("nan"), "n": 0}
    mean = statistics.fmean(values)
    if n < 2:
        return {"mean": mean, "ci95": float("nan"), "n": n}
    half = T975.get(n - 1, 1.96) * statistics.stdev(values) / math.sqrt(n)
    return {"mean": mean, "ci95": half, "n": n}


def classify_positions(model: Any, ctx: Any, response_ids: torch.Tensor,
                       valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """Bool [B, R] masks of the response positions: ``spurious`` (the token is in the planted
    template set), ``grounded`` (the token occurs in the row's prompt, i.e. in the grounded set
    m_b, which excludes the template set) and ``other``; each a subset of ``valid``."""
    m, _ = model.prompt_tokens(ctx.input_ids, ctx.attention_mask)  # [B, V]
    spurious = model.spurious_mask[response_ids] & valid
    grounded = m.gather(1, response_ids) & valid & ~spurious
    return {"spurious": spurious, "grounded": grounded, "other": valid & ~spurious & ~grounded}


def optional_float(text: str) -> float | None:
    """A float, or ``none`` / ``null`` for no value (argparse type)."""
    return None if text.lower() in ("none", "null") else float(text)


def filter_params(args: argparse.Namespace) -> dict[str, Any]:
    """SA-OPD's hyperparameters, shared by the calibrated ablations (``match_sa_opd``)."""
    return {"p1": args.p1, "p2": args.p2, "beta_min": args.beta_min, "beta_max": args.beta_max}


# ---- models and prompts ----------------------------------------------------------------------
def build_pair(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    from saopd.config.model import ModelConfig, PlantedConfig
    from saopd.models.factory import build_model

    student, tok = build_model(ModelConfig(name_or_path="saopd:smollm2-135m-instruct",
                                           prune_every=3 if args.student == "pruned" else None))
    teacher, _ = build_model(ModelConfig(
        name_or_path="saopd:smollm2-135m-instruct",
        planted=PlantedConfig(spurious_bonus=args.spurious_bonus,
                              grounded_bonus=args.grounded_bonus)))
    teacher.eval().requires_grad_(False)
    return student, teacher, tok


def prompts(split: str, n: int, seed: int | None) -> list[Any]:
    """``n`` GSM8K records of ``split``: a seeded sample of train, or the first n of test."""
    import random

    from saopd.prompts.text import GSM8K_DIR, gsm8k_records

    records, _ = gsm8k_records(GSM8K_DIR / f"{split}.jsonl")
    if seed is None:
        return records[:n]
    return random.Random(seed).sample(records, n)


# ---- phase 1: filter rates on the same signals -----------------------------------------------
def bias_contributions(teacher: Any, tok: Any, batch: Any, args: argparse.Namespace
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each planted bias's own contribution to A_full at every response position, [B, R]:
    dA_s = lp_base - lp_{spurious only} and dA_g = lp_base - lp_{grounded only}, scored on the
    full context with teachers that share the base model and carry one bias each. (With the
    unpruned student, lp_base = lpS, so A_full ~ dA_s + dA_g: the biases are all of it.)"""
    from saopd.config.model import PlantedConfig
    from saopd.scoring.passes import response_source
    from saopd.signals import score_tokens
    from saopd.testbeds.planted import plant_priors

    def lp(model: Any) -> torch.Tensor:
        return score_tokens(response_source(model, batch.full), batch.response_ids).logprobs

    base = teacher.base
    only_s = plant_priors(base, tok, PlantedConfig(spurious_bonus=args.spurious_bonus,
                                                   grounded_bonus=0.0))
    only_g = plant_priors(base, tok, PlantedConfig(spurious_bonus=0.0,
                                                   grounded_bonus=args.grounded_bonus))
    with torch.no_grad():
        lp_base = lp(base)
        return lp_base - lp(only_s), lp_base - lp(only_g)


def source_classes(d_s: torch.Tensor, d_g: torch.Tensor, valid: torch.Tensor,
                   threshold: float) -> dict[str, torch.Tensor]:
    """Positions by the source of their distillation signal: ``spurious`` where the
    input-agnostic prior's contribution |dA_s| is >= ``threshold`` and larger than the grounded
    one, ``grounded`` where |dA_g| is >= ``threshold`` and at least |dA_s|, ``weak`` where
    both are below ``threshold``. Bool [B, R] each, a partition of ``valid``."""
    s, g = d_s.abs(), d_g.abs()
    strong = valid & (torch.maximum(s, g) >= threshold)
    spurious = strong & (s > g)
    return {"spurious": spurious, "grounded": strong & ~spurious, "weak": valid & ~strong}


def filter_rates(args: argparse.Namespace) -> dict[str, Any]:
    from saopd.contexts.text import collate_contexts
    from saopd.filters import FILTERS
    from saopd.rollout.base import SamplingParams
    from saopd.rollout.hf import HFGenerateEngine
    from saopd.scoring.passes import ScoringNeeds, score_frozen, score_student

    student, teacher, tok = build_pair(args)
    engine = HFGenerateEngine(student, tok, max_prompt_length=256, prompt_truncation="skip")
    needs = ScoringNeeds(residual=True)
    per_seed = []
    for seed in args.seeds:
        t0 = time.perf_counter()
        recs = prompts("train", args.rate_prompts, seed=10_000 + seed)
        sampling = SamplingParams(n=1, temperature=1.0, top_p=1.0,
                                  max_new_tokens=args.max_new_tokens, seed=seed)
        rollouts = engine.generate([r.messages for r in recs], sampling)
        batch = collate_contexts(tok, rollouts.row_messages(),
                                 [r.response_ids for r in rollouts.rollouts],
                                 prompt_ids=[r.prompt_ids for r in rollouts.rollouts])
        with torch.no_grad():
            frozen = score_frozen(batch, student=student, teacher=teacher, reference=None,
                                  needs=needs)
            signals = score_student(batch, frozen, student=student, needs=needs)
        valid = batch.response_mask
        d_s, d_g = bias_contributions(teacher, tok, batch, args)
        views = {"source": source_classes(d_s, d_g, valid, args.signal_threshold),
                 "token": classify_positions(teacher, batch.full, batch.response_ids, valid)}
        a, gap = signals.a_full.abs(), signals.grounding_gap
        row: dict[str, Any] = {"seed": seed, "tokens": signals.num_valid, "methods": {},
                               "spurious_signal_share_all": float(
                                   d_s.abs()[valid].sum() / (d_s.abs() + d_g.abs())[valid].sum())}
        for view, classes in views.items():
            row[view] = {c: {"positions": int(m.sum()),
                             "abs_a_full": float(a[m].mean()) if m.any() else None,
                             "grounding_gap": float(gap[m].mean()) if m.any() else None}
                         for c, m in classes.items()}
        for name in FILTERS:
            generator = torch.Generator().manual_seed(seed)
            result = FILTERS.build(name, **filter_params(args))(signals, generator=generator)
            f = result.filtered
            entry: dict[str, Any] = {
                "filtered_share": result.stats["filtered_ratio"], "flmr": result.stats["flmr"],
                "n_filtered": int(f.sum()),
                # of the planted signal on the filtered tokens, the share the spurious prior made
                "spurious_signal_share": (float(d_s.abs()[f].sum() /
                                                (d_s.abs() + d_g.abs())[f].sum())
                                          if f.any() else None)}
            for view, classes in views.items():
                entry[view] = {c: float(f[m].float().mean()) if m.any() else None
                               for c, m in classes.items()}
            row["methods"][name] = entry
        row["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"[rates] seed {seed}: {json.dumps(row)}", flush=True)
        per_seed.append(row)

    def ci(values: list[float | None]) -> dict[str, float]:
        return mean_ci([v for v in values if v is not None])

    summary: dict[str, Any] = {"spurious_signal_share_all": ci(
        [r["spurious_signal_share_all"] for r in per_seed])}
    for name in FILTERS:
        rows = [r["methods"][name] for r in per_seed]
        summary[name] = {
            view: {c: ci([e[view][c] for e in rows]) for c in rows[0][view]}
            for view in ("source", "token")}
        summary[name]["filtered_share"] = ci([e["filtered_share"] for e in rows])
        summary[name]["spurious_signal_share"] = ci([e["spurious_signal_share"] for e in rows])
        summary[name]["spurious_minus_grounded"] = ci(
            [e["source"]["spurious"] - e["source"]["grounded"] for e in rows
             if e["source"]["spurious"] is not None and e["source"]["grounded"] is not None])
    return {"per_seed": per_seed, "summary": summary,
            "signal_threshold": args.signal_threshold}


# ---- phases 2 and 3: train, then measure what the student emits ------------------------------
def eval_batch(student: Any, tok: Any, args: argparse.Namespace) -> tuple[list[Any], Any]:
    """The fixed evaluation problems and fixed contexts: one response per problem sampled once
    from the untrained student (seed 0), collated as full contexts for the template-mass
    measurement."""
    from saopd.contexts.text import collate_contexts
    from saopd.rollout.base import SamplingParams
    from saopd.rollout.hf import HFGenerateEngine

    recs = prompts("test", args.eval_problems, seed=None)
    engine = HFGenerateEngine(student, tok, max_prompt_length=256, prompt_truncation="truncate")
    rollouts = engine.generate([r.messages for r in recs], SamplingParams(
        n=1, temperature=1.0, top_p=1.0, max_new_tokens=args.eval_max_new_tokens, seed=0))
    batch = collate_contexts(tok, rollouts.row_messages(),
                             [r.response_ids for r in rollouts.rollouts],
                             prompt_ids=[r.prompt_ids for r in rollouts.rollouts])
    return recs, batch


@torch.no_grad()
def template_mass(student: Any, teacher: Any, batch: Any) -> dict[str, float]:
    """Expected emission rates on fixed contexts: the mean over response positions of the
    student's probability of the template set S and of the row's prompt-token set m_b,
    sum_{v in S} pi_S(v | ctx) (teacher-forced, so no sampling noise)."""
    m, _ = teacher.prompt_tokens(batch.full.input_ids, batch.full.attention_mask)  # [B, V]
    sp, pr, n = 0.0, 0.0, 0
    was_training = student.training
    student.eval()
    for row in range(batch.full.input_ids.shape[0]):
        ctx = batch.full
        keep = batch.response_mask[row]
        index = ctx.gather_index[row][keep]  # [R_b]
        logits = student(input_ids=ctx.input_ids[row:row + 1],
                         attention_mask=ctx.attention_mask[row:row + 1]).logits[0, index]
        p = logits.float().softmax(-1)  # [R_b, V]
        v = p.shape[-1]
        sp += float(p[:, teacher.spurious_mask[:v]].sum())
        pr += float(p[:, m[row, :v]].sum())
        n += int(keep.sum())
    student.train(was_training)
    return {"template_mass": sp / n, "prompt_mass": pr / n}


def emission_stats(student: Any, teacher: Any, tok: Any, args: argparse.Namespace,
                   seed: int, fixed: tuple[list[Any], Any]) -> dict[str, Any]:
    """Template mass on the fixed contexts; then one sampled response per fixed problem:
    template-token rate, prompt-copy rate and accuracy."""
    from saopd.contexts.text import collate_contexts
    from saopd.eval.grading import grade_many
    from saopd.rollout.base import SamplingParams
    from saopd.rollout.hf import HFGenerateEngine

    recs, fixed_batch = fixed
    out: dict[str, Any] = template_mass(student, teacher, fixed_batch)
    engine = HFGenerateEngine(student, tok, max_prompt_length=256, prompt_truncation="truncate",
                              batch_size=args.eval_batch)
    sampling = SamplingParams(n=1, temperature=1.0, top_p=1.0,
                              max_new_tokens=args.eval_max_new_tokens, seed=1_000 + seed)
    rollouts = engine.generate([r.messages for r in recs], sampling)
    batch = collate_contexts(tok, rollouts.row_messages(),
                             [r.response_ids for r in rollouts.rollouts],
                             prompt_ids=[r.prompt_ids for r in rollouts.rollouts])
    classes = classify_positions(teacher, batch.full, batch.response_ids, batch.response_mask)
    n = int(batch.response_mask.sum())
    texts = [tok.decode(r.response_ids, skip_special_tokens=True) for r in rollouts.rollouts]
    golds = [recs[r.prompt_index].answer for r in rollouts.rollouts]
    correct = grade_many(list(zip(texts, golds, strict=True)), workers=1)
    out.update({"tokens": n, "template_rate": int(classes["spurious"].sum()) / n,
                "prompt_copy_rate": int(classes["grounded"].sum()) / n,
                "accuracy": sum(bool(c) for c in correct) / len(correct),
                "finished": sum(r.finished for r in rollouts.rollouts) / len(rollouts.rollouts),
                "example": texts[0][:300]})
    return out


class _Capture(L.Callback):
    """Runs ``fn(student)`` when training ends and keeps its result (no checkpoint reloads)."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.result = fn, None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.result = self.fn(pl_module.student)


def train_and_eval(args: argparse.Namespace, teacher: Any, tok: Any,
                   fixed: tuple[list[Any], Any], save: Any = None) -> dict[str, Any]:
    """Train every (seed, method) and evaluate; ``save(partial)`` after each run."""
    from hydra import compose, initialize_config_dir

    from saopd.train import CONF_DIR, train

    runs: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="planted_prior_"))
    try:
        for seed in args.seeds:
            for method in args.methods:
                t0 = time.perf_counter()
                overrides = [
                    f"paths.root={REPO}", f"paths.output_dir={work / f'{method}_s{seed}'}",
                    "experiment=smollm2_gsm8k", "model@teacher=smollm2_135m_instruct_planted",
                    f"model@student={STUDENT_CONFIGS[args.student]}",
                    f"teacher.planted.spurious_bonus={args.spurious_bonus}",
                    f"teacher.planted.grounded_bonus={args.grounded_bonus}",
                    f"filter={method}", f"seed={seed}", f"steps={args.steps}",
                    *([] if method == "none" else
                      [f"filter.{k}={'null' if v is None else v}"
                       for k, v in filter_params(args).items()]),
                    f"prompts_per_step={args.prompts_per_step}",
                    f"rollout.max_new_tokens={args.max_new_tokens}",
                    f"optim.lr={args.lr}", "optim.warmup_steps=0", "logger=none",
                    f"trainer.checkpoint_every_n_steps={args.steps}",
                    "trainer.view_every_n_steps=0", "trainer.progress_bar=false",
                    "step.log_entropy=false",
                ]
                with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
                    cfg = compose("train", overrides=overrides)
                capture = _Capture(lambda s, seed=seed: emission_stats(s, teacher, tok, args,
                                                                       seed, fixed))
                summary = train(cfg, extra_callbacks=[capture])
                m = summary["metrics"]
                run = {"method": method, "seed": seed, "steps": summary["steps"],
                       "train_seconds": summary["seconds"],
                       "final": {k.removeprefix("train/"): v for k, v in m.items()
                                 if k in ("train/kl", "train/filtered_ratio", "train/flmr",
                                          "train/loss")},
                       "eval": capture.result, "seconds": round(time.perf_counter() - t0, 1)}
                e = run["eval"]
                print(f"[train] {method} seed {seed}: {run['steps']} steps, template mass "
                      f"{e['template_mass']:.4f}, prompt mass {e['prompt_mass']:.4f}, template "
                      f"rate {e['template_rate']:.4f}, prompt-copy {e['prompt_copy_rate']:.4f}, "
                      f"accuracy {e['accuracy']:.3f} ({run['seconds']} s)", flush=True)
                runs.append(run)
                shutil.rmtree(work / f"{method}_s{seed}", ignore_errors=True)
                if save is not None:
                    save({"runs": runs, "summary": summarize(runs, args.methods)})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"runs": runs, "summary": summarize(runs, args.methods)}


def summarize(runs: list[dict[str, Any]], methods: list[str]) -> dict[str, Any]:
    """Per method: mean and 95% CI over seeds, and the paired difference from vanilla OPD."""
    summary: dict[str, Any] = {}
    for method in methods:
        mine = {r["seed"]: r["eval"] for r in runs if r["method"] == method}
        if not mine:
            continue
        base = {r["seed"]: r["eval"] for r in runs if r["method"] == "none"}
        entry = {k: mean_ci([e[k] for e in mine.values()])
                 for k in EVAL_KEYS}
        if method != "none" and base:
            for k in EVAL_KEYS:
                entry[f"{k}_minus_vanilla"] = mean_ci([mine[s][k] - base[s][k] for s in mine
                                                       if s in base])
        summary[method] = entry
    return summary


# ---- plots -----------------------------------------------------------------------------------
def plot(results: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if "rates" in results:
        s = results["rates"]["summary"]
        fig, ax = plt.subplots(figsize=(7.5, 3.6))
        width = 0.26
        for i, c in enumerate(SOURCE_CLASSES):
            xs = [j + (i - 1) * width for j in range(len(FILTERS))]
            ax.bar(xs, [s[m]["source"][c]["mean"] for m in FILTERS], width,
                   yerr=[s[m]["source"][c]["ci95"] for m in FILTERS], capsize=3,
                   label=SOURCE_LABELS[c])
        ax.set_xticks(range(len(FILTERS)), FILTERS)
        ax.set_ylabel("P(filtered | position class)")
        ax.set_title("Same signals, equal filtered share (mean, 95% CI over seeds)", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "filter_rates.png", dpi=130)
        plt.close(fig)
        written.append("filter_rates.png")
    if "train" in results:
        s = results["train"]["summary"]
        methods = [m for m in METHODS if m in s]
        fig, axes = plt.subplots(1, 5, figsize=(16, 3.4))
        labels = ("template mass (fixed contexts)", "template-token rate (sampled)",
                  "prompt-token mass (fixed contexts)", "prompt-copy rate (sampled)",
                  "GSM8K accuracy (Avg@1)")
        for ax, key, label in zip(axes, EVAL_KEYS, labels, strict=True):
            ax.bar(range(len(methods)), [s[m][key]["mean"] for m in methods],
                   yerr=[s[m][key]["ci95"] for m in methods], capsize=3,
                   color=["grey" if m == "none" else "C0" for m in methods])
            if "initial" in results:
                ax.axhline(results["initial"][key], color="k", ls=":", lw=1,
                           label="before training")
                ax.legend(fontsize=7)
            ax.set_xticks(range(len(methods)), methods, rotation=30, fontsize=8)
            ax.set_title(label, fontsize=9)
        fig.suptitle("Student after training against the planted teacher (mean, 95% CI)",
                     fontsize=10)
        fig.tight_layout()
        fig.savefig(out / "inheritance.png", dpi=130)
        plt.close(fig)
        written.append("inheritance.png")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", choices=["rates", "train", "all"], default="all")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--student", choices=sorted(STUDENT_CONFIGS), default="full",
                        help="full: SmolLM2-135M-Instruct itself (30 layers, the default: the "
                        "10-layer pruned copy emits no coherent text and no template token); "
                        "pruned: its 10-layer copy")
    parser.add_argument("--spurious-bonus", type=float, default=4.0)
    parser.add_argument("--grounded-bonus", type=float, default=4.0)
    parser.add_argument("--rate-prompts", type=int, default=16,
                        help="prompts per seed in the rates phase")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--p1", type=float, default=0.2)
    parser.add_argument("--p2", type=float, default=0.3)
    parser.add_argument("--beta-min", type=optional_float, default=0.05,
                        help="SA-OPD's lower FLMR bound (Algorithm 2's grow branch); at the "
                        "paper's fixed p1 = 0.2, p2 = 0.3 SA-OPD filters ~nothing here (README)")
    parser.add_argument("--beta-max", type=optional_float, default=None)
    parser.add_argument("--signal-threshold", type=float, default=0.5,
                        help="nats of planted signal that make a position 'spurious' or "
                        "'grounded' in the rates phase")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--eval-problems", type=int, default=12)
    parser.add_argument("--eval-batch", type=int, default=16)
    parser.add_argument("--eval-max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's; 1 is faster on a shared box)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    if "none" not in args.methods and args.phase != "rates":
        parser.error("--methods must include none (vanilla OPD, the reference)")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)

    started = time.perf_counter()
    results: dict[str, Any] = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"threads": torch.get_num_threads(), "torch": torch.__version__,
                    "python": platform.python_version(),
                    "load_at_start": os.getloadavg()},
    }
    path = args.out / "results.json"
    if path.is_file() and args.phase != "all":  # keep the other phase's results
        old = json.loads(path.read_text())
        results.update({k: v for k, v in old.items() if k in ("rates", "train", "initial")})
    if args.phase in ("rates", "all"):
        results["rates"] = filter_rates(args)
    if args.phase in ("train", "all"):
        student, teacher, tok = build_pair(args)
        fixed = eval_batch(student, tok, args)
        results["initial"] = emission_stats(student, teacher, tok, args, 0, fixed)
        print(f"[initial] {results['initial']}", flush=True)
        del student
        def save(partial: dict[str, Any]) -> None:
            results["train"] = partial
            path.write_text(json.dumps(results, indent=2) + "\n")

        results["train"] = train_and_eval(args, teacher, tok, fixed, save)
    results["seconds"] = round(time.perf_counter() - started, 1)
    results["machine"]["load_at_end"] = os.getloadavg()
    results["figures"] = plot(results, args.out)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path} and {results['figures']} in {results['seconds']} s")


if __name__ == "__main__":
    main()
