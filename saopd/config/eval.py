"""Schema of evaluation: during training (``eval``) and ``saopd-eval`` (``conf/eval.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from saopd.choices import ROLLOUT_SAMPLERS
from saopd.config.model import ModelConfig
from saopd.config.rollout import RolloutConfig
from saopd.validation import check_choice, check_fraction, check_int, check_positive

__all__ = ["EvalConfig", "EvalDuringTrainingConfig"]


@dataclass
class EvalDuringTrainingConfig:
    """Evaluation of the live student every N steps (same code as ``saopd-eval``).

    Attributes:
        every_n_steps: evaluate every this many steps and after the last one (0 = never).
        at_start: also evaluate the student before the first step (logged at step index -1;
            ``saopd-train`` prints it beside the last evaluation); needs ``every_n_steps`` > 0.
        benchmarks: registered benchmark names (``saopd.eval.benchmarks.BENCHMARKS``; gsm8k
            reads the vendored test split).
        limit: problems per benchmark (a fixed subset: the first ``limit``).
        k, temperature, top_p, max_new_tokens: sampling per problem (Avg@k), the same for every
            benchmark: a quick check of the live student, not the records' paper settings
            (``saopd-eval`` on a checkpoint uses those).
        data_dir: where ``dvc repro prepare_eval`` writes the prepared benchmarks.
        batch_size: problems per ``generate`` call (each repeated ``k`` times); the sampling
            seed of a batch is ``seed + its first index``, so another ``batch_size`` draws
            other samples.
        sampler: the HF engine's token draw (``multinomial`` | ``inverse_cdf``; see
            ``rollout.sampler`` in :class:`saopd.config.rollout.HFRolloutConfig`).
    """

    every_n_steps: int = 0
    at_start: bool = False
    benchmarks: list[str] = field(default_factory=lambda: ["gsm8k"])
    limit: int | None = 32
    k: int = 1
    temperature: float = 1.0
    top_p: float = 0.95
    max_new_tokens: int = 256
    data_dir: str = MISSING
    batch_size: int = 8
    sampler: str = "multinomial"

    def __post_init__(self) -> None:
        check_int("batch_size", self.batch_size, owner="eval")
        check_choice("sampler", self.sampler, ROLLOUT_SAMPLERS, owner="eval")
        if not isinstance(self.every_n_steps, int) or self.every_n_steps < 0:
            raise ValueError(f"eval.every_n_steps must be an int >= 0, got {self.every_n_steps!r}")
        if not isinstance(self.at_start, bool):
            raise ValueError(f"eval.at_start must be true or false, got {self.at_start!r}")
        if self.at_start and not self.every_n_steps:
            raise ValueError("eval.at_start needs eval.every_n_steps > 0 (the evaluation to "
                             "compare with)")
        check_int("k", self.k, owner="eval")
        check_int("limit", self.limit, owner="eval", allow_none=True)
        check_int("max_new_tokens", self.max_new_tokens, owner="eval")


#: Sampling fields of a rollout config that ``saopd-eval`` takes from its own keys instead.
_EVAL_SAMPLING = {"n": "k", "temperature": "temperature", "top_p": "top_p",
                  "max_new_tokens": "max_new_tokens"}


@dataclass
class EvalConfig:
    """``saopd-eval``'s config (``conf/eval.yaml``).

    Each benchmark's own settings (the paper's k, max new tokens, its file and grader) are its
    record in :data:`saopd.eval.benchmarks.BENCHMARKS`; the keys here override them.

    Attributes:
        model: the model to evaluate (hub id, path, tiny); ignored when ``checkpoint`` or
            ``run_id`` names a training run, whose student config is used instead.
        rollout: the engine that samples (``conf/rollout/<engine>.yaml``: ``rollout=hf``, the
            default, or ``rollout=vllm``), typed by the engine's dataclass
            (:mod:`saopd.config.rollout`). Only its engine options apply (``batch_size``,
            ``greedy``, vLLM's); sampling is set here, so its ``n``, ``temperature``, ``top_p``
            and ``max_new_tokens`` must stay at their defaults.
        checkpoint: a saopd training checkpoint; its student weights are evaluated.
        run_id: an MLflow training run: its last checkpoint is evaluated and the results are
            logged into that run. With ``checkpoint`` too, that checkpoint is evaluated instead
            (one of the run's earlier steps); it must record that MLflow run, else it is refused.
        benchmarks: registered benchmark names (``saopd.eval.benchmarks.BENCHMARKS``: gsm8k,
            math500, aime24, aime25, amc23, minerva_math, synth_vqa, evochart, mmifeval,
            countqa, mathvision, geo3k, mathvista).
        data_dir: where ``dvc repro prepare_eval`` writes the math benchmarks; the records'
            files are relative to it.
        k: samples per problem (Avg@k) for every benchmark; null: each benchmark's paper k
            (Avg@8; accuracy, k = 1, for MATH500).
        k_per_benchmark: k of single benchmarks, over ``k`` and the records
            (``+k_per_benchmark.aime24=16``).
        temperature, top_p: sampling (the paper: 1.0, 0.95).
        max_new_tokens: response length limit of single benchmarks, over the records' (the
            paper's: 18,000 for math, 1,024 for GSM8K and visual understanding, 4,096 for visual
            reasoning); ``+max_new_tokens.gsm8k=256`` (the ``+`` adds a key to the empty map).
        limit: evaluate only the first ``limit`` problems of each benchmark.
        batch_size: problems per ``generate`` call.
        grade_workers: processes grading answers (None = one per core, 0 = in this process).
        seed: sampling seed (each batch of problems draws with ``seed + its first index``).
        device: where the model runs (cpu | cuda).
        output_dir: per-sample JSONL files and ``results.json``.
        tracking_uri: MLflow store (null: ``sqlite:///<repo>/mlflow.db``); a local SQLite
            store keeps the artifacts of experiments created here beside its file.
        experiment_name: the MLflow experiment of a new run (``run_id`` null).
        log_to_mlflow: log scores and files to MLflow.
        chat_template_kwargs: extra chat-template variables (``{enable_thinking: false}``:
            Qwen3 / Qwen3.5's non-thinking mode), for text and vision-language models; over the
            training run's (``chat_template_from_run``), key by key.
        chat_template_from_run: when ``checkpoint`` or ``run_id`` names a training run, start
            from that run's ``data.chat_template_kwargs`` (its saved ``.hydra/config.yaml``), so
            its student is evaluated on the prompts it was trained on (a paper student in
            non-thinking mode stays in it); false: only ``chat_template_kwargs``.
        mmifeval_judge: ``"module:callable"`` of an LLM judge for MM-IFEval's judge-only
            constraints (:data:`saopd.eval.mmifeval.MMIFEvalJudge`); null: those are reported as
            ungraded and left out of the score.
    """

    model: ModelConfig = MISSING  # conf/model/<name>.yaml (the defaults list: model@model)
    rollout: Any = MISSING  # one of the RolloutConfig subclasses (conf/rollout/<engine>.yaml)
    checkpoint: str | None = None
    run_id: str | None = None
    benchmarks: list[str] = field(default_factory=lambda: ["gsm8k"])
    data_dir: str = MISSING
    k: int | None = None
    k_per_benchmark: dict[str, int] = field(default_factory=dict)
    temperature: float = 1.0
    top_p: float = 0.95
    max_new_tokens: dict[str, int] = field(default_factory=dict)
    limit: int | None = None
    batch_size: int = 8
    grade_workers: int | None = None
    seed: int = 0
    device: str = "cpu"
    output_dir: str = MISSING
    tracking_uri: str | None = None
    experiment_name: str = "eval"
    log_to_mlflow: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    chat_template_from_run: bool = True
    mmifeval_judge: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rollout, RolloutConfig):
            raise ValueError("rollout must be one engine's config (conf/rollout/<engine>.yaml), "
                             f"got {type(self.rollout).__name__}")
        defaults = type(self.rollout)()
        for key, ours in _EVAL_SAMPLING.items():
            if getattr(self.rollout, key) != getattr(defaults, key):
                raise ValueError(f"rollout.{key} is not used by saopd-eval: set {ours} instead")
        if not self.benchmarks:
            raise ValueError("benchmarks must name at least one benchmark")
        check_int("k", self.k, allow_none=True)
        for key, mapping in (("k_per_benchmark", self.k_per_benchmark),
                             ("max_new_tokens", self.max_new_tokens)):
            for name, value in mapping.items():
                check_int(f"{key}.{name}", value)
        check_positive("temperature", self.temperature)
        check_fraction("top_p", self.top_p)
        check_int("limit", self.limit, allow_none=True)
        check_int("batch_size", self.batch_size)
        check_int("grade_workers", self.grade_workers, minimum=0, allow_none=True)
        check_int("seed", self.seed, minimum=0)
