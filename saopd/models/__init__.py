"""Models and tokenizers: loading (hub id, folder, GGUF; SmolLM2 offline), layer pruning, the
teacher/student vocabulary check, tokenizers built offline, tiny test models, vision-language
processors, building a checked pair (:mod:`saopd.models.factory`) and FSDP2 sharding."""

from saopd.models.loading import HubUnavailableError, load_causal_lm, load_tokenizer, resolve_dtype
from saopd.models.pruning import decoder_stack, prune_layers
from saopd.models.smollm2 import SMOLLM2_CHAT_TEMPLATE, smollm2_135m_instruct, smollm2_gguf_path
from saopd.models.tiny import tiny_llama, tiny_qwen3, tiny_tokenizer
from saopd.models.tokenizers import qwen_tokenizer, saopd_cache_root
from saopd.models.vocab import VocabularyReport, check_vocabularies

__all__ = [
    "SMOLLM2_CHAT_TEMPLATE",
    "HubUnavailableError",
    "VocabularyReport",
    "check_vocabularies",
    "decoder_stack",
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
