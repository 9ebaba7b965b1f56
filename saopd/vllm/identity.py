"""What a served model is, as a server reports it and a client compares it: the architecture and
sizes of its config (:data:`CONFIG_KEYS`). The rollout servers' model must have the student's
values (its weights are replaced by every sync); a teacher server's, the teacher's (and its
weight files' fingerprint, :mod:`saopd.vllm.weights_files`). Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["CONFIG_KEYS", "config_differences", "config_values"]

#: The config fields a server reports and a client compares.
CONFIG_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
               "tie_word_embeddings")


def config_values(config: Any) -> dict[str, Any]:
    """The :data:`CONFIG_KEYS` values (plain JSON scalars) of a ``transformers`` config, read
    from its text config (a vision-language model's language model)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    out = {}
    for key in CONFIG_KEYS:
        value = getattr(text, key, None)
        if isinstance(value, (bool, int, float, str)):
            out[key] = value
    return out


def config_differences(served: Mapping[str, Any], reference: Mapping[str, Any],
                       label: str) -> list[str]:
    """``"<key> <served> (<label>: <reference>)"`` for each key both give with other values."""
    return [f"{key} {served[key]!r} ({label}: {reference[key]!r})" for key in CONFIG_KEYS
            if key in served and reference.get(key) is not None
            and served[key] != reference[key]]
