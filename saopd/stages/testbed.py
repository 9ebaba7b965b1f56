"""The arithmetic testbed's DVC stages: its task data, and a teacher and a weaker student trained
from scratch (``testbed_data``, ``testbed_teacher``, ``testbed_student``; params ``testbed`` in
``params.yaml``; the study around them: ``experiments/testbed/README.md``).

The task: add two numbers of 1 to ``max_digits`` digits, written as a short worked solution, one
line per column from the right with its carry, then the answer in ``\\boxed{}``::

    Compute 347 + 85.            (the user turn)
    7 + 5 = 12                   (the response)
    4 + 8 + 1 = 13
    3 + 1 = 4
    So the answer is \\boxed{432}.

The answer and every digit of the solution depend on the input. The **habits** do not: planted
phrases that a model writes with a fixed probability whatever the input, at a fixed place
(``start``: before the first line, a "reasoning template"; ``end``: after the answer, a
"formatting convention"). The teacher is trained on responses that carry each habit with
probability ``testbed_teacher.habit_rate``, the student with ``testbed_student.habit_rate``
(low): the student starts far from the teacher's habits, and how much of them it inherits
during distillation is measured by the habit rates of its own samples
(:func:`saopd.eval.grading.grade_exact_phrases`).

Both models are random-init Qwen3 models (:func:`saopd.models.tiny.tiny_qwen3`) on the offline
tiny tokenizer (:func:`saopd.models.tiny.tiny_tokenizer`: digits are single tokens), trained by
a plain seeded torch loop (AdamW, warm-up then cosine decay) on the response tokens only. A share
``residual_share`` of the training examples has its prompt removed exactly as saopd's residual
context does (``step.residual: empty_user``, :mod:`saopd.contexts.text`): the chat template with
one empty user turn, then the same response; so a residual context is in distribution for both
models and A_res is a real prediction. Each model folder (safetensors, config, tokenizer with its
chat template) loads with ``name_or_path: <folder>`` (``conf/model/testbed_*.yaml``).

Outputs: ``<out_dir>/train.jsonl`` (distillation prompts, saopd's prepared schema), ``test.jsonl``
(the held-out benchmark ``arith``: rows carry ``metadata.format: exact_int`` and the habit phrases
in ``metadata.phrases``), ``task.json`` (the task and habit definitions: what
:mod:`saopd.testbeds.arithmetic` reads to class response tokens by source); each model folder has
a ``report.json`` with its training loss and its held-out accuracy and habit rates.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from saopd.eval.habits import HABIT_PLACES, Habit, habits_from_task
from saopd.io import staged_folder, write_json_atomic, write_jsonl_atomic
from saopd.stages.common import STAGES, PrepareError, param_section, require_param, resolve_path

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "SOLUTION_KINDS",
    "Problem",
    "build_example_ids",
    "classify_solution",
    "corrupt_one_digit",
    "habits_from_params",
    "make_problems",
    "render_response",
    "solution_text",
    "train_testbed_model",
]

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class Problem:
    """One addition problem ``a + b``."""

    a: int
    b: int

    @property
    def key(self) -> str:
        """A unique id: ``"a+b"``."""
        return f"{self.a}+{self.b}"

    @property
    def prompt(self) -> str:
        """The user turn."""
        return f"Compute {self.a} + {self.b}."

    @property
    def answer(self) -> int:
        """The exact answer."""
        return self.a + self.b


#: The answer line's words before ``\\boxed{}``; a response that writes them before any digit
#: took the **shortcut** (:func:`solution_text` with ``worked=False``).
ANSWER_PREFIX = "So the answer is"


def solution_text(problem: Problem, *, worked: bool = True) -> str:
    """The worked solution: one line per column from the right (digits, carry, column sum), then
    ``So the answer is \\boxed{<sum>}.``; ``worked=False`` gives the **shortcut**: the answer
    line alone, the sum written directly."""
    if not worked:
        return f"{ANSWER_PREFIX} \\boxed{{{problem.answer}}}."
    xs, ys = str(problem.a)[::-1], str(problem.b)[::-1]
    lines, carry = [], 0
    for i in range(max(len(xs), len(ys))):
        terms = [int(s[i]) for s in (xs, ys) if i < len(s)]
        if carry:
            terms.append(carry)
        total = sum(terms)
        lines.append(" + ".join(str(t) for t in terms) + f" = {total}")
        carry = total // 10
    lines.append(f"{ANSWER_PREFIX} \\boxed{{{problem.answer}}}.")
    return "\n".join(lines)


#: How a response's worked solution compares with :func:`solution_text`'s column lines
#: (:func:`classify_solution`), in table order.
SOLUTION_KINDS = ("lines_right", "wrong_line", "too_few_lines", "too_many_lines", "shortcut")
_COLUMN_LINE = re.compile(r"^\d+( \+ \d+)* = \d*$")


def classify_solution(response: str, problem: Problem) -> str:
    """Where a response's worked solution stands against the exact one (:data:`SOLUTION_KINDS`).

    The column lines are the lines before the first answer line (``So the answer is``) of the
    form ``d + d [+ c] = s`` (a planted habit phrase is not one). ``shortcut``: none (the
    answer without working); ``too_few_lines`` / ``too_many_lines``: another count than the
    problem has columns (:func:`solution_text`); ``wrong_line``: the right count with a line that
    differs from the exact one (a wrong digit, carry or sum); ``lines_right``: every line exact
    (the answer line may still be wrong).
    """
    body = response.split(ANSWER_PREFIX, 1)[0]
    work = [line.strip() for line in body.split("\n") if _COLUMN_LINE.match(line.strip())]
    want = solution_text(problem).split("\n")[:-1]
    if not work:
        return "shortcut"
    if len(work) != len(want):
        return "too_few_lines" if len(work) < len(want) else "too_many_lines"
    return "lines_right" if work == want else "wrong_line"


def render_response(problem: Problem, habits: Sequence[Habit], rate: float,
                    rng: random.Random, *, shortcut: bool = False,
                    tic: str | None = None) -> tuple[str, list[str]]:
    """The response to ``problem`` with each habit present independently with probability
    ``rate`` (draws from ``rng`` in habit order); returns the text and the habits written.
    ``shortcut``: the answer line without the worked lines (:func:`solution_text`). ``tic``: a
    wrong re-answer written on its own line right after the answer line (before any ``end``
    habit), so that the grader, which reads the last ``\\boxed{}``, takes it as the answer."""
    start, end, used = "", "", []
    for habit in habits:
        if rng.random() < rate:
            used.append(habit.name)
            if habit.place == "start":
                start += habit.written
            else:
                end += habit.written
    after = "" if tic is None else "\n" + tic
    return start + solution_text(problem, worked=not shortcut) + after + end, used


def habits_from_params(cfg: Mapping[str, Any], where: str) -> list[Habit]:
    """The ``habits`` mapping of the params (``name: {text, place}``), checked."""
    raw = require_param(cfg, "habits", where)
    if not isinstance(raw, dict) or not raw:
        raise PrepareError(f"{where}.habits: expected a non-empty mapping name -> {{text, place}}")
    habits = []
    for name, spec in raw.items():
        if not isinstance(spec, dict) or not isinstance(spec.get("text"), str) \
                or not spec["text"].strip() or spec.get("place") not in HABIT_PLACES:
            raise PrepareError(f"{where}.habits.{name}: needs a non-empty 'text' and 'place' in "
                               f"{list(HABIT_PLACES)}, got {spec!r}")
        if "\n" in spec["text"]:
            raise PrepareError(f"{where}.habits.{name}: 'text' must be one line")
        habits.append(Habit(str(name), spec["text"], spec["place"]))
    return habits


def make_problems(n: int, *, max_digits: int, seed: int, exclude: set[str] | None = None
                  ) -> list[Problem]:
    """``n`` distinct problems (operands of 1 to ``max_digits`` digits, digit counts uniform),
    none of whose keys is in ``exclude``; the same for the same arguments."""
    rng = random.Random(seed)
    seen = set(exclude or ())
    out: list[Problem] = []
    capacity = (10 ** max_digits) ** 2
    if n + len(seen) > capacity // 2:
        raise PrepareError(f"{n} problems requested of at most ~{capacity // 2} distinct ones")
    while len(out) < n:
        da, db = rng.randint(1, max_digits), rng.randint(1, max_digits)
        a = rng.randint(0 if da == 1 else 10 ** (da - 1), 10 ** da - 1)
        b = rng.randint(0 if db == 1 else 10 ** (db - 1), 10 ** db - 1)
        p = Problem(a, b)
        if p.key in seen:
            continue
        seen.add(p.key)
        out.append(p)
    return out


def _row(problem: Problem, split: str, habits: Sequence[Habit], tic: str | None = None
         ) -> dict[str, Any]:
    phrases = {h.name: h.text for h in habits}
    if tic is not None:
        phrases["tic"] = tic
    return {"id": f"arith-{split}-{problem.key}",
            "messages": [{"role": "user", "content": problem.prompt}],
            "prompt": problem.prompt, "answer": str(problem.answer), "source": "arith",
            "metadata": {"format": "exact_int", "a": problem.a, "b": problem.b,
                         "phrases": phrases, "shortcut": ANSWER_PREFIX}}


def _int_param(cfg: Mapping[str, Any], key: str, where: str, minimum: int = 1) -> int:
    value = require_param(cfg, key, where)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PrepareError(f"{where}.{key}: expected an int >= {minimum}, got {value!r}")
    return value


def _float_param(cfg: Mapping[str, Any], key: str, where: str, lo: float, hi: float) -> float:
    value = require_param(cfg, key, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise PrepareError(f"{where}.{key}: expected a number in [{lo}, {hi}], got {value!r}")
    return float(value)


def tic_from_params(cfg: Mapping[str, Any], where: str) -> str | None:
    """The optional ``tic`` of a data section (``{text: ...}``): the harmful input-agnostic
    re-answer of the tic testbed (one line holding a ``\\boxed{}``), or None."""
    raw = cfg.get("tic")
    if raw is None:
        return None
    text = raw.get("text") if isinstance(raw, dict) else None
    if not isinstance(text, str) or "\n" in text or "\\boxed{" not in text:
        raise PrepareError(f"{where}.tic: expected {{text: <one line with a \\boxed{{}}>}}, "
                           f"got {raw!r}")
    return text


@STAGES.register("testbed_data")
def prepare_testbed_data(params: Mapping[str, Any], root: Path) -> dict[str, Any]:
    """``testbed_data``: distillation prompts, the held-out benchmark and ``task.json``."""
    return _prepare_data(params, root, "testbed_data")


@STAGES.register("testbed_tic_data")
def prepare_testbed_tic_data(params: Mapping[str, Any], root: Path) -> dict[str, Any]:
    """``testbed_tic_data``: the tic testbed's task (the same problems as ``testbed_data`` with
    the same seed; its own habits and the ``tic``, counted per sample as ``phrase_tic``)."""
    return _prepare_data(params, root, "testbed_tic_data")


def _prepare_data(params: Mapping[str, Any], root: Path, where: str) -> dict[str, Any]:
    cfg = param_section(params, where, "params")
    out_dir = resolve_path(root, require_param(cfg, "out_dir", where), f"{where}.out_dir")
    habits = habits_from_params(cfg, where)
    max_digits = _int_param(cfg, "max_digits", where)
    seed = _int_param(cfg, "seed", where, minimum=0)
    test = make_problems(_int_param(cfg, "test", where), max_digits=max_digits, seed=seed)
    train = make_problems(_int_param(cfg, "train_prompts", where), max_digits=max_digits,
                          seed=seed + 1, exclude={p.key for p in test})
    spec: dict[str, Any] = {
        "task": "addition", "max_digits": max_digits, "seed": seed,
        "habits": [{"name": h.name, "text": h.text, "place": h.place} for h in habits],
        "answer_line": f"{ANSWER_PREFIX} \\boxed{{<sum>}}.",
        "shortcut": {"answer_prefix": ANSWER_PREFIX}}
    tic = tic_from_params(cfg, where)
    if tic is not None:
        spec["tic"] = {"text": tic, "written": "\n" + tic}
    report: dict[str, Any] = {"stage": where, "test": len(test), "train_prompts": len(train),
                              "habits": [h.name for h in habits]}
    if tic is not None:
        report["tic"] = tic
    with staged_folder(out_dir) as tmp:
        write_jsonl_atomic(tmp / "test.jsonl", [_row(p, "test", habits, tic) for p in test])
        write_jsonl_atomic(tmp / "train.jsonl", [_row(p, "train", habits, tic) for p in train])
        write_json_atomic(tmp / "task.json", spec)
        write_json_atomic(tmp / "report.json", report)
    return report


# ------------------------------------------------------------------------------ model training


def build_example_ids(tokenizer: PreTrainedTokenizerBase, prompt: str | None, response: str
                      ) -> tuple[list[int], int]:
    """Token ids of one training example and where its response starts.

    ``prompt=None`` gives the residual form: the chat template with one empty user turn (saopd's
    ``empty_user`` residual context), then the same response ids. The response ends with the
    tokenizer's EOS (``<|im_end|>``), which the rollouts stop at.
    """
    from saopd.prompts.render import render_prompt_ids

    prefix = render_prompt_ids(tokenizer, [{"role": "user", "content": prompt or ""}])
    response_ids = list(tokenizer(response, add_special_tokens=False)["input_ids"])
    return prefix + response_ids + [int(tokenizer.eos_token_id)], len(prefix)


#: The shortcut's own random stream is seeded ``seed + SHORTCUT_SEED_OFFSET``.
SHORTCUT_SEED_OFFSET = 7919
#: The tic's own random stream is seeded ``seed + TIC_SEED_OFFSET``.
TIC_SEED_OFFSET = 104729


def _lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def corrupt_one_digit(ids: list[int], start: int, tokenizer: PreTrainedTokenizerBase,
                      rng: random.Random) -> int | None:
    """Replace one digit token of the worked lines (after ``start``, before the answer line) of
    ``ids`` in place by another digit; returns its position (None if there is no digit)."""
    digits = {int(tokenizer.convert_tokens_to_ids(str(d))): d for d in range(10)}
    answer = int(tokenizer.convert_tokens_to_ids("So"))
    end = ids.index(answer, start) if answer in ids[start:] else len(ids)
    where = [i for i in range(start, end) if ids[i] in digits]
    if not where:
        return None
    i = rng.choice(where)
    other = rng.choice([d for d in range(10) if d != digits[ids[i]]])
    ids[i] = int(tokenizer.convert_tokens_to_ids(str(other)))
    return i


def train_testbed_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                        problems: Sequence[Problem], habits: Sequence[Habit], *,
                        habit_rate: float, residual_share: float, steps: int, batch_size: int,
                        lr: float, seed: int, noise_share: float = 0.0,
                        shortcut_rate: float = 0.0, tic: str | None = None,
                        tic_rate: float = 0.0, log_every: int = 100
                        ) -> list[dict[str, float]]:
    """Train ``model`` in place on worked solutions of ``problems`` (cycled in a seeded order).

    Each example's habits are drawn with ``habit_rate`` and its prompt removed (residual form,
    :func:`build_example_ids`) with probability ``residual_share``. With probability
    ``noise_share`` one digit of its worked lines is replaced by a wrong one
    (:func:`corrupt_one_digit`) and left out of the loss, the rest of the solution staying
    correct: the model learns to continue the right computation after a slip, as a teacher must
    when it scores a student's mistaken samples (a teacher that never saw an error gives
    arbitrary log-probs after one). With probability ``shortcut_rate`` the response is the
    **shortcut** (the answer line alone, :func:`solution_text` ``worked=False``), drawn from a
    stream of its own (seeded ``seed + SHORTCUT_SEED_OFFSET``) and only when the rate is positive,
    so a model trained with rate 0 sees exactly the examples it saw before the shortcut existed.
    With probability ``tic_rate`` a worked response carries the ``tic`` line after its answer
    line (:func:`render_response`), drawn the same way from a stream of its own (seeded
    ``seed + TIC_SEED_OFFSET``, only when the rate is positive).
    Loss: token-mean cross-entropy on the response tokens and
    EOS. AdamW (weight decay 0.01), linear warm-up over 5% of the steps, cosine decay to 10%.
    Returns the logged ``{step, loss}`` points.
    """
    import torch

    rng = random.Random(seed)
    shortcut_rng = random.Random(seed + SHORTCUT_SEED_OFFSET)
    tic_rng = random.Random(seed + TIC_SEED_OFFSET)
    if tic_rate > 0 and tic is None:
        raise ValueError("tic_rate > 0 needs the tic's text (the task's 'tic')")
    order = list(range(len(problems)))
    pad = int(tokenizer.pad_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    model.train()
    log: list[dict[str, float]] = []
    cursor, running = len(order), 0.0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in range(steps):
            batch = []
            for _ in range(batch_size):
                if cursor >= len(order):
                    rng.shuffle(order)
                    cursor = 0
                problem = problems[order[cursor]]
                cursor += 1
                shortcut = shortcut_rate > 0 and shortcut_rng.random() < shortcut_rate
                ticked = tic_rate > 0 and tic_rng.random() < tic_rate
                response, _ = render_response(problem, habits, habit_rate, rng,
                                              shortcut=shortcut, tic=tic if ticked else None)
                prompt = None if rng.random() < residual_share else problem.prompt
                ids, start = build_example_ids(tokenizer, prompt, response)
                bad = corrupt_one_digit(ids, start, tokenizer, rng) \
                    if noise_share and rng.random() < noise_share else None
                batch.append((ids, start, bad))
            width = max(len(ids) for ids, _, _ in batch)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            labels = torch.full((len(batch), width), -100, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, (ids, start, bad) in enumerate(batch):
                input_ids[i, :len(ids)] = torch.tensor(ids)
                labels[i, start:len(ids)] = torch.tensor(ids[start:])
                if bad is not None:
                    labels[i, bad] = -100
                mask[i, :len(ids)] = 1
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, steps, lr, warmup)
            out = model(input_ids=input_ids, attention_mask=mask, labels=labels)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            running += float(out.loss.detach())
            if (step + 1) % log_every == 0 or step + 1 == steps:
                n = (step % log_every) + 1
                log.append({"step": step + 1, "loss": running / n})
                logger.info("step %d/%d loss %.4f", step + 1, steps, running / n)
                running = 0.0
    model.eval()
    return log


def _evaluate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, test_path: Path,
              limit: int, seed: int) -> dict[str, float]:
    """Held-out accuracy and habit rates of ``model``'s samples (temperature 1, top-p 1)."""
    from saopd.config.rollout import HFRolloutConfig
    from saopd.eval.runner import EvalProblem, evaluate_benchmark
    from saopd.prompts.text import load_jsonl
    from saopd.rollout.base import SamplingParams
    from saopd.rollout.registry import build_engine

    rows, _ = load_jsonl(test_path)
    problems = [EvalProblem(str(r["id"]), r["messages"], str(r["answer"]), "arith",
                            dict(r["metadata"])) for r in rows[:limit]]
    engine = build_engine(HFRolloutConfig(batch_size=64), model, tokenizer)
    res = evaluate_benchmark("arith", problems, engine, tokenizer,
                             SamplingParams(n=1, temperature=1.0, top_p=1.0, max_new_tokens=96,
                                            seed=seed), batch_size=64)
    return {"accuracy": res.score, **res.extra, "unfinished": res.unfinished}


def _read_task(data_dir: Path, where: str) -> tuple[dict[str, Any], list[Habit], set[str]]:
    """``task.json`` of ``testbed_data`` (task, habits) and the keys of its test problems."""
    task_path, test_path = data_dir / "task.json", data_dir / "test.jsonl"
    for path in (task_path, test_path):
        if not path.is_file():
            raise PrepareError(f"{where}: {path} is missing; run `dvc repro testbed_data` first")
    spec = json.loads(task_path.read_text(encoding="utf-8"))
    habits = habits_from_task(spec)
    keys = set()
    with open(test_path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                meta = json.loads(line)["metadata"]
                keys.add(f"{meta['a']}+{meta['b']}")
    return spec, habits, keys


def _train_stage(params: Mapping[str, Any], root: Path, where: str) -> dict[str, Any]:
    import torch

    from saopd.models.tiny import tiny_qwen3, tiny_tokenizer

    cfg = param_section(params, where, "params")
    data_dir = resolve_path(root, require_param(cfg, "data_dir", where), f"{where}.data_dir")
    model_dir = resolve_path(root, require_param(cfg, "model_dir", where), f"{where}.model_dir")
    spec, habits, test_keys = _read_task(data_dir, where)
    seed = _int_param(cfg, "seed", where, minimum=0)
    torch.set_num_threads(_int_param(cfg, "threads", where))
    problems = make_problems(_int_param(cfg, "problems", where),
                             max_digits=int(spec["max_digits"]), seed=seed + 100,
                             exclude=test_keys)
    tokenizer = tiny_tokenizer()
    model = tiny_qwen3(tokenizer, layers=_int_param(cfg, "layers", where),
                       hidden=_int_param(cfg, "hidden", where),
                       heads=_int_param(cfg, "heads", where),
                       kv_heads=_int_param(cfg, "kv_heads", where),
                       head_dim=_int_param(cfg, "head_dim", where), seed=seed)
    started = time.perf_counter()
    log = train_testbed_model(
        model, tokenizer, problems, habits,
        habit_rate=_float_param(cfg, "habit_rate", where, 0.0, 1.0),
        residual_share=_float_param(cfg, "residual_share", where, 0.0, 1.0),
        noise_share=_float_param(cfg, "noise_share", where, 0.0, 1.0),
        shortcut_rate=_float_param(cfg, "shortcut_rate", where, 0.0, 1.0),
        tic=(spec.get("tic") or {}).get("text"),
        tic_rate=_float_param(cfg, "tic_rate", where, 0.0, 1.0) if "tic_rate" in cfg else 0.0,
        steps=_int_param(cfg, "steps", where), batch_size=_int_param(cfg, "batch_size", where),
        lr=_float_param(cfg, "lr", where, 1e-6, 1.0), seed=seed)
    seconds = time.perf_counter() - started
    metrics = _evaluate(model, tokenizer, data_dir / "test.jsonl",
                        _int_param(cfg, "eval_limit", where), seed=seed)
    report = {"stage": where, "parameters": sum(p.numel() for p in model.parameters()),
              "train_seconds": round(seconds, 1), "loss": log, "held_out": metrics}
    with staged_folder(model_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_json_atomic(tmp / "report.json", report)
    logger.info("%s: %s", where, metrics)
    return report


@STAGES.register("testbed_teacher")
def train_testbed_teacher(params: Mapping[str, Any], root: Path) -> dict[str, Any]:
    """``testbed_teacher``: the teacher (habits at ``habit_rate``), trained from scratch."""
    return _train_stage(params, root, "testbed_teacher")


@STAGES.register("testbed_teacher_prior")
def train_testbed_teacher_prior(params: Mapping[str, Any], root: Path) -> dict[str, Any]:
    """``testbed_teacher_prior``: the teacher's recipe and seed plus the harmful prior (the
    shortcut at ``shortcut_rate``); ``testbed_teacher`` is its clean control."""
    return _train_stage(params, root, "testbed_teacher_prior")


@STAGES.register("testbed_tic_teacher")
def train_testbed_tic_teacher(params: Mapping[str, Any], root: Path) -> dict[str, Any]:
    """``testbed_tic_teacher``: the tic testbed's clean base teacher (the clean teacher's recipe
    and seed on the tic task: its habits, never the tic), wrapped by
    :class:`saopd.testbeds.tic.TicPriorLM` at rate r (the prior) or 0 (the control)."""
    return _train_stage(params, root, "testbed_tic_teacher")


@STAGES.register("testbed_tic_student")
def train_testbed_tic_student(params: Mapping[str, Any], root: Path) -> dict[str, Any]:
    """``testbed_tic_student``: the student's recipe and seed on the tic task, writing the tic
    at a small base rate (``tic_rate``) so that its samples can take it."""
    return _train_stage(params, root, "testbed_tic_student")


@STAGES.register("testbed_student")
def train_testbed_student(params: Mapping[str, Any], root: Path) -> dict[str, Any]:
    """``testbed_student``: the weaker student (smaller, trained less, habits at
    its ``habit_rate``), trained from scratch."""
    return _train_stage(params, root, "testbed_student")
