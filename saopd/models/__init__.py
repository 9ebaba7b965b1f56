"""Model and tokenizer adapters: loading (hub id or local path, SmolLM2 offline), layer pruning,
teacher/student vocabulary checks, real tokenizers built offline and tiny test models."""

from saopd.models.loading import (
    SMOLLM2_CHAT_TEMPLATE,
    HubUnavailableError,
    VocabularyReport,
    check_same_vocabulary,
    decoder_layers,
    load_causal_lm,
    load_tokenizer,
    prune_layers,
    resolve_dtype,
    smollm2_135m_instruct,
    smollm2_gguf_path,
)
from saopd.models.tiny import tiny_llama, tiny_qwen3, tiny_tokenizer
from saopd.models.tokenizers import qwen_tokenizer, saopd_cache_root

__all__ = [
    "SMOLLM2_CHAT_TEMPLATE",
    "HubUnavailableError",
    "VocabularyReport",
    "check_same_vocabulary",
    "decoder_layers",
    "load_causal_lm",
    "load_tokenizer",
    "prune_layers",
    "qwen_tokenizer",
    "resolve_dtype",
    "saopd_cache_root",
    "smollm2_135m_instruct",
    "smollm2_gguf_path",
    "tiny_llama",
    "tiny_qwen3",
    "tiny_tokenizer",
]
