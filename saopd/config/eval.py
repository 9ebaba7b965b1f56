"""Schema of evaluation: during training (``eval``) and ``saopd-eval`` (``conf/eval.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from saopd.config.model import ModelConfig
from saopd.validation import check_int

__all__ = ["EvalConfig", "EvalDuringTrainingConfig"]


@dataclass
class EvalDuringTrainingConfig:
    """Evaluation of the live student every N steps (same code as ``saopd-eval``).

    Attributes:
        every_n_steps: 0 = never.
        benchmarks: gsm8k (vendored test split) and/or prepared benchmarks in ``data_dir``.
        limit: problems per benchmark (a fixed subset: the first ``limit``).
        k, temperature, top_p, max_new_tokens: sampling per problem (Avg@k).
        data_dir: where ``dvc repro prepare_eval`` writes the prepared benchmarks.
    """

    every_n_steps: int = 0
    benchmarks: list[str] = field(default_factory=lambda: ["gsm8k"])
    limit: int | None = 32
    k: int = 1
    temperature: float = 1.0
    top_p: float = 0.95
    max_new_tokens: int = 256
    data_dir: str = MISSING

    def __post_init__(self) -> None:
        if not isinstance(self.every_n_steps, int) or self.every_n_steps < 0:
            raise ValueError(f"eval.every_n_steps must be an int >= 0, got {self.every_n_steps!r}")
        check_int("k", self.k, owner="eval")
        check_int("limit", self.limit, owner="eval", allow_none=True)
        check_int("max_new_tokens", self.max_new_tokens, owner="eval")


DEFAULT_MAX_NEW_TOKENS = {"math500": 18000, "aime24": 18000, "aime25": 18000, "amc23": 18000,
                          "minerva_math": 18000, "gsm8k": 1024,
                          # VLM benchmarks (paper, Appendix B): 1,024 new tokens for visual
                          # understanding, 4,096 for visual reasoning
                          "synth_vqa": 1024, "evochart": 1024, "mmifeval": 1024, "countqa": 1024,
                          "mathvision": 4096, "geo3k": 4096, "mathvista": 4096}


@dataclass
class EvalConfig:
    """``saopd-eval``'s config (``conf/eval.yaml``).

    Attributes:
        model: the model to evaluate (hub id, path, tiny); ignored when ``checkpoint`` or
            ``run_id`` names a training run, whose student config is used instead.
        checkpoint: a saopd training checkpoint; its student weights are evaluated.
        run_id: an MLflow training run: its last checkpoint is evaluated and the results are
            logged into that run.
        benchmarks: names (gsm8k, math500, aime24, aime25, amc23, minerva_math).
        k: samples per problem (Avg@k); ``k_per_benchmark`` overrides it per benchmark.
        temperature, top_p: sampling (the paper: 1.0, 0.95).
        max_new_tokens: per benchmark; unnamed benchmarks use ``default_max_new_tokens``.
        limit: evaluate only the first ``limit`` problems of each benchmark.
        batch_size: problems per ``generate`` call.
        grade_workers: processes grading answers (None = one per core).
        device: where the model runs (cpu | cuda).
        chat_template_kwargs: extra chat-template variables for vision-language models
            (``{enable_thinking: false}``: Qwen3.5's non-thinking mode).
        mmifeval_judge: ``"module:callable"`` of an LLM judge for MM-IFEval's judge-only
            constraints (:data:`saopd.eval.mmifeval.MMIFEvalJudge`); null: those are reported as
            ungraded and left out of the score.
    """

    model: ModelConfig = MISSING  # conf/model/<name>.yaml (the defaults list: model@model)
    checkpoint: str | None = None
    run_id: str | None = None
    benchmarks: list[str] = field(default_factory=lambda: ["gsm8k"])
    data_dir: str = MISSING
    k: int = 8
    k_per_benchmark: dict[str, int] = field(default_factory=dict)
    temperature: float = 1.0
    top_p: float = 0.95
    max_new_tokens: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_MAX_NEW_TOKENS))
    default_max_new_tokens: int = 4096
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
    mmifeval_judge: str | None = None
