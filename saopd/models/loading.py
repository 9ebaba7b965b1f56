"""Loading students and teachers from HF hub ids, local folders or GGUF files (SmolLM2 offline:
:mod:`saopd.models.smollm2`; pruning: :mod:`saopd.models.pruning`; the pair's vocabulary check:
:mod:`saopd.models.vocab`).

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

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError

from saopd.models.smollm2 import SMOLLM2_ALIAS, smollm2_135m_instruct

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "HubUnavailableError",
    "init_causal_lm",
    "load_causal_lm",
    "load_pretrained_model",
    "load_tokenizer",
    "meta_causal_lm",
    "resolve_dtype",
]


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
    if name.lower() == SMOLLM2_ALIAS:
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
    """``loader.from_pretrained``, turning hub connectivity failures into HubUnavailableError and
    an unreadable (truncated, corrupt) safetensors file into an ``OSError`` naming the model."""
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
    except SafetensorError as err:  # a truncated or corrupt weights file
        raise OSError(f"{source.location}: a safetensors weights file cannot be read ({err}); "
                      "it is truncated or corrupt: download or convert it again") from None
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
    device: str | torch.device | None = None,
) -> PreTrainedModel:
    """Load a causal LM (eval mode) from a local folder, a ``.gguf`` file or a hub id.

    ``device``: load each weight straight onto this device, in ``dtype`` (transformers'
    ``device_map``), so that no CPU copy of the model is built and then moved; None = the CPU,
    as transformers loads by default. GGUF weights are de-quantised to ``dtype``; such a model
    cannot be ``save_pretrained``-ed (see :func:`smollm2_135m_instruct` for the conversion).
    Raises ``FileNotFoundError`` for a missing local path and :class:`HubUnavailableError` when
    the hub is needed but unreachable.
    """
    from transformers import AutoModelForCausalLM

    extra: dict[str, Any] = {}
    if device is not None:
        extra["device_map"] = {"": torch.device(device)}
    return load_pretrained_model(AutoModelForCausalLM, name_or_path, dtype=dtype,
                                 trust_remote_code=trust_remote_code, revision=revision,
                                 gguf_file=gguf_file, **extra)


def load_pretrained_model(
    auto_class: Any,
    name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype,
    trust_remote_code: bool,
    revision: str | None,
    gguf_file: str | None = None,
    **kwargs: Any,
) -> PreTrainedModel:
    """``auto_class.from_pretrained`` (a transformers auto class) of a local folder, a ``.gguf``
    file or a hub id, in ``dtype``, eval mode: how :func:`load_causal_lm` and
    :func:`saopd.models.vlm.load_vlm` load. ``kwargs`` go to ``from_pretrained``; the errors
    are :func:`resolve_source`'s and :func:`from_pretrained`'s."""
    source = resolve_source(name_or_path, gguf_file, kind="model")
    model = from_pretrained(auto_class, source, ("config.json",), revision,
                            dtype=resolve_dtype(dtype), trust_remote_code=trust_remote_code,
                            **kwargs)
    return model.eval()


def init_causal_lm(
    config: Any,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device | None = None,
    seed: int = 0,
) -> PreTrainedModel:
    """A randomly initialised causal LM of ``config`` (a transformers config), eval mode.

    Built directly on ``device`` (None = the CPU) in ``dtype``: every parameter is allocated
    once, in its final dtype and place (no float32 model built first and then cast, no CPU copy
    moved afterwards), so peak memory is about the model's bytes. Weights are drawn from
    transformers' own initialisation after ``torch.manual_seed(seed)`` (on a GPU the stream
    differs from the CPU's for the same seed). ``device="meta"`` builds the structure only
    (shapes and dtypes, no memory, nothing drawn: the global RNG is left alone), for FSDP's
    meta-device initialisation (:func:`saopd.models.sharding.materialize_sharded`).
    """
    from transformers import AutoModelForCausalLM

    resolved = resolve_dtype(dtype)
    if not isinstance(resolved, torch.dtype):
        raise ValueError("init_causal_lm needs an explicit dtype, not 'auto'")
    place = torch.device(device) if device is not None else torch.device("cpu")
    if place.type != "meta":
        torch.manual_seed(seed)
    with place:
        model = AutoModelForCausalLM.from_config(config, dtype=resolved)
    return model.eval()


def meta_causal_lm(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "float32",
    trust_remote_code: bool = False,
    revision: str | None = None,
) -> PreTrainedModel:
    """The model :func:`load_causal_lm` loads from ``name_or_path``, built on the ``meta``
    device from its config alone (every tensor with its shape and dtype, none allocated, no
    weights read): each FSDP rank's skeleton before sharding. ``dtype="auto"`` takes the
    config's ``dtype`` (float32 when it names none); a checkpoint stored in another dtype then
    differs from the loaded model, which :func:`saopd.models.sharding.materialize_sharded`
    reports. GGUF files are refused (``ValueError``): their config comes from the file."""
    from transformers import AutoConfig

    source = resolve_source(name_or_path, None, kind="model")
    if source.gguf_file is not None:
        raise ValueError(f"meta_causal_lm cannot build a GGUF model ({name_or_path!s})")
    config = from_pretrained(AutoConfig, source, ("config.json",), revision,
                             trust_remote_code=trust_remote_code)
    resolved = resolve_dtype(dtype)
    if not isinstance(resolved, torch.dtype):
        named = getattr(config, "dtype", None)
        resolved = resolve_dtype(named) if isinstance(named, (str, torch.dtype)) else "float32"
        resolved = resolved if isinstance(resolved, torch.dtype) else torch.float32
    return init_causal_lm(config, dtype=resolved, device="meta")


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


# --------------------------------------------------------------------------------------------------
# layer pruning


# --------------------------------------------------------------------------------------------------
# teacher / student compatibility


