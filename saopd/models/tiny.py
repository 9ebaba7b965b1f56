"""Tiny, deterministic models and a small real tokenizer for fast offline tests.

``tiny_tokenizer()`` trains a byte-level BPE (vocabulary ~1k) on a few hundred generated lines with
the Qwen pre-tokeniser, adds ChatML special tokens and Qwen3's chat template. ``tiny_qwen3`` and
``tiny_llama`` build random-init causal LMs sized to a tokenizer's vocabulary, identical for the
same arguments and seed, without touching the global torch RNG.
"""

from __future__ import annotations

import functools
import random
from typing import TYPE_CHECKING, Any

import torch

from saopd.models.tokenizers import QWEN3_CHAT_TEMPLATE, QWEN_PRETOKENIZE_REGEX

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "TINY_SPECIAL_TOKENS",
    "tiny_corpus",
    "tiny_llama",
    "tiny_qwen3",
    "tiny_tokenizer",
]

# ids 0..3, in this order
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
_TINY_VOCAB_SIZE = 1024

_SUBJECTS = ["Alice", "Bob", "The teacher", "A student", "Maria", "The farmer", "Li Wei", "Zoë"]
_OBJECTS = ["apples", "books", "marbles", "coins", "pencils", "cookies", "tickets", "stones"]
_VERBS = ["has", "buys", "finds", "gives away", "sells", "collects", "loses", "keeps"]
_WORDS = [
    "the",
    "answer",
    "is",
    "question",
    "please",
    "solve",
    "step",
    "by",
    "first",
    "then",
    "finally",
    "so",
    "we",
    "get",
    "therefore",
    "total",
    "number",
    "of",
    "each",
    "more",
    "less",
    "than",
    "twice",
    "half",
    "sum",
    "product",
    "difference",
    "equation",
    "value",
    "let",
    "x",
    "y",
    "be",
    "integer",
    "real",
    "positive",
    "negative",
    "prime",
    "divisible",
    "remainder",
    "triangle",
    "circle",
    "area",
    "radius",
    "angle",
    "degrees",
    "probability",
    "expected",
    "count",
    "ways",
    "choose",
    "order",
    "box",
    "final",
    "result",
    "check",
    "you",
    "are",
    "a",
    "helpful",
    "assistant",
    "think",
    "carefully",
    "explain",
    "reasoning",
    "show",
    "work",
    "simplify",
    "compute",
]
_UNICODE = ["café", "naïve", "π ≈ 3.14159", "√2", "x² + y² = z²", "数学", "θ", "→", "😀", "Ωmega"]


def tiny_corpus(n_lines: int = 600, seed: int = 0) -> list[str]:
    """Deterministic pseudo-math text (``n_lines`` lines) used to train ``tiny_tokenizer``."""
    rng = random.Random(seed)
    lines = [
        "You are a helpful assistant.",
        "Please answer the question.",
        "system user assistant",
        "Please reason step by step, and put your final answer within \\boxed{}.",
    ]
    while len(lines) < n_lines:
        kind = rng.randrange(4)
        a, b = rng.randint(0, 999), rng.randint(1, 99)
        if kind == 0:
            s, o, v = rng.choice(_SUBJECTS), rng.choice(_OBJECTS), rng.choice(_VERBS)
            lines.append(f"{s} {v} {a} {o} and then {b} more. How many {o} are there?")
        elif kind == 1:
            op, res = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
            lines.append(f"We compute {a} {op} {b} = {res}, so the answer is \\boxed{{{res}}}.")
        elif kind == 2:
            words = rng.choices(_WORDS, k=rng.randint(5, 14))
            lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ":"]))
        else:
            lines.append(f"Let x = {a}. Then {rng.choice(_UNICODE)} and x/{b} = {a / b:.3f}")
    return lines


@functools.lru_cache(maxsize=1)
def _tiny_backend_json() -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=_TINY_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(tiny_corpus(), trainer=trainer)
    return tok.to_str()


def tiny_tokenizer() -> PreTrainedTokenizerBase:
    """A small but real HF fast tokenizer (byte-level BPE, ~1k tokens), built offline.

    Special tokens: ``<|endoftext|>`` (0), ``<|im_start|>`` (1), ``<|im_end|>`` (2, eos),
    ``<|pad|>`` (3, pad); no bos (as Qwen). Chat template: Qwen3's ChatML (no default system).
    Every string round-trips through encode/decode (byte-level alphabet). The trained backend is
    cached per process; each call returns a new wrapper, so callers may mutate it freely.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_tiny_backend_json())
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
        chat_template=QWEN3_CHAT_TEMPLATE,
    )
    tok.add_bos_token = False
    return tok


def _vocab_size_for(tokenizer: PreTrainedTokenizerBase, vocab_size: int | None) -> int:
    n = len(tokenizer)
    if vocab_size is None:
        return n
    if vocab_size < n:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {n} tokens")
    return int(vocab_size)


def _seeded_from_config(config, seed: int) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def _check_dims(layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
    for name, v in (
        ("layers", layers),
        ("hidden", hidden),
        ("heads", heads),
        ("kv_heads", kv_heads),
        ("head_dim", head_dim),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")


def _common_config(tokenizer: PreTrainedTokenizerBase, layers: int, hidden: int, heads: int,
                   kv_heads: int, head_dim: int, intermediate: int | None,
                   vocab_size: int | None, initializer_range: float,
                   tie_word_embeddings: bool) -> dict[str, Any]:
    """Config fields shared by the tiny Qwen3 and Llama models (dimensions checked)."""
    _check_dims(layers, hidden, heads, kv_heads, head_dim)
    return {
        "vocab_size": _vocab_size_for(tokenizer, vocab_size),
        "hidden_size": hidden,
        "intermediate_size": intermediate or 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 4096,
        "initializer_range": initializer_range,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def tiny_qwen3(
    tokenizer: PreTrainedTokenizerBase,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 2,
    kv_heads: int = 1,
    head_dim: int = 32,
    intermediate: int | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
    initializer_range: float = 0.02,
    tie_word_embeddings: bool = True,
) -> PreTrainedModel:
    """A random-init ``Qwen3ForCausalLM`` (fp32, eval mode) sized to ``tokenizer``.

    ``vocab_size`` defaults to ``len(tokenizer)`` (may be larger, as real Qwen models pad to
    151,936); ``intermediate`` defaults to ``2 * hidden``. head_dim 32 is the smallest that
    vLLM's CPU attention supports. Same arguments and seed give identical weights.
    """
    from transformers import Qwen3Config

    config = Qwen3Config(
        **_common_config(tokenizer, layers, hidden, heads, kv_heads, head_dim, intermediate,
                         vocab_size, initializer_range, tie_word_embeddings),
        max_window_layers=layers,
    )
    return _seeded_from_config(config, seed)


def tiny_llama(
    tokenizer: PreTrainedTokenizerBase,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 2,
    kv_heads: int = 1,
    head_dim: int = 32,
    intermediate: int | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
    initializer_range: float = 0.02,
    tie_word_embeddings: bool = True,
) -> PreTrainedModel:
    """A random-init ``LlamaForCausalLM`` (the SmolLM2 architecture), fp32, eval mode.

    Same conventions as :func:`tiny_qwen3`.
    """
    from transformers import LlamaConfig

    config = LlamaConfig(
        **_common_config(tokenizer, layers, hidden, heads, kv_heads, head_dim, intermediate,
                         vocab_size, initializer_range, tie_word_embeddings),
    )
    return _seeded_from_config(config, seed)
