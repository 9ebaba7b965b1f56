"""Data parallelism and FSDP2 sharding of the student and the frozen teacher.

Under DDP (``trainer.strategy=ddp``) every rank holds whole models and its share of the step's
rollouts. Under FSDP (``trainer.strategy=fsdp``, Lightning's ``ModelParallelStrategy``, i.e.
PyTorch's FSDP2 ``fully_shard``) each decoder layer and the root of each model are sharded across
the data-parallel ranks. Student and teacher (and the ExOPD reference) are sharded *separately*,
with their own ``fully_shard`` calls: Lightning's ``FSDPStrategy`` cannot wrap two sub-models
apart (Lightning issue #20138), which is why saopd uses FSDP2 here.

Both strategies average gradients over the ``W`` data-parallel ranks. The step's loss is a
global reduction (Eq. 19 normalises by the batch's global count of loss-carrying tokens), so each
rank back-propagates ``W x`` its own share of that global loss: the averaged gradient is then
exactly the full-batch gradient of one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of a ``transformers`` model (its ``_no_split_modules``).

    Raises ``ValueError`` if the model declares none or none are found: sharding only the root
    would gather the whole model at once, which defeats FSDP.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__} to shard "
            f"(its _no_split_modules is {sorted(names) or 'empty'})")
    return layers


def is_fsdp2(model: nn.Module) -> bool:
    """True if ``model`` was sharded with FSDP2's ``fully_shard`` (:func:`shard_model` always
    shards the root, so checking the root is enough)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch < 2.6
        return False
    return isinstance(model, FSDPModule)


def shard_model(model: nn.Module, mesh: Any, *, mixed_precision: str | None = None,
                activation_checkpointing: bool = False, frozen: bool = False) -> nn.Module:
    """Shard ``model`` in place with FSDP2: one ``fully_shard`` per decoder layer, then the root.

    Args:
        model: a ``transformers`` causal LM.
        mesh: the data-parallel ``DeviceMesh`` (Lightning's ``self.device_mesh["data_parallel"]``).
        mixed_precision: ``"bf16"`` computes in bfloat16 with fp32 master weights and fp32
            gradient reduction; None keeps the parameters' dtype.
        activation_checkpointing: recompute each decoder layer in backward (trainable models).
        frozen: a model that never gets gradients (the teacher): its layers are resharded after
            each forward and no activation checkpointing is applied.

    The root keeps its parameters (embeddings, final norm, LM head) gathered after its forward,
    which the chunked LM-head scoring (:mod:`saopd.scoring.passes`) relies on.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"mesh": mesh}
    if mixed_precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    elif mixed_precision is not None:
        raise ValueError(f"mixed_precision must be 'bf16' or None, got {mixed_precision!r}")
    layers = decoder_layers(model)
    if activation_checkpointing and not frozen:
        enable_activation_checkpointing(model)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant checkpointing).

    Uses the model's own ``gradient_checkpointing_enable`` (``transformers``), which applies
    in training mode only, so rollouts and frozen passes are unaffected.
    """
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing "
                         "(no gradient_checkpointing_enable)")
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@contextmanager
def no_backward_sync(strategy: Any, enabled: bool) -> Iterator[None]:
    """Skip the data-parallel gradient reduction of the backward calls inside (micro-batches).

    DDP accumulates gradients locally and reduces them at the next synchronised backward; for
    other strategies this is a no-op (each backward reduces, which is correct, only slower).
    """
    block = getattr(strategy, "block_backward_sync", None)
    if enabled and block is not None:
        with block():
            yield
    else:
        yield


# --------------------------------------------------------------------------------------------------
# meta-device initialisation: build empty, shard, then fill only this rank's shards

#: The attribute of a meta-device model (:func:`defer_weights`) holding how rank 0 builds the
#: same model, full, on the CPU.
FULL_MODEL_ATTR = "saopd_full_model"


def defer_weights(model: nn.Module, build_full: Callable[[], nn.Module]) -> nn.Module:
    """Mark ``model`` (built on the ``meta`` device: structure, shapes, dtypes, no memory) as
    filled later by :func:`materialize_sharded` from ``build_full()``, a zero-argument callable
    that builds the same model on the CPU with its real weights (run on rank 0 only). The mark
    follows ``copy.deepcopy`` (a frozen reference copied from a meta student fills the same way).
    Returns ``model``."""
    if not is_meta(model):
        raise ValueError(f"defer_weights needs a model on the meta device ({type(model).__name__}"
                         " has parameters or buffers elsewhere)")
    setattr(model, FULL_MODEL_ATTR, build_full)
    return model


def is_meta(model: nn.Module) -> bool:
    """True if any parameter or buffer of ``model`` is on the ``meta`` device (not allocated)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def tied_pairs(model: nn.Module) -> list[tuple[str, str]]:
    """``(name, first name)`` for every parameter registered under two names (tied embeddings:
    ``("lm_head.weight", "model.embed_tokens.weight")``), names as in ``named_parameters``."""
    first: dict[int, str] = {}
    pairs = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            pairs.append((name, first[id(param)]))
        else:
            first[id(param)] = name
    return pairs


def _retie(model: nn.Module, pairs: list[tuple[str, str]]) -> None:
    for name, source in pairs:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        setattr(owner, attr, model.get_parameter(source))


def _layout_mismatch(full: dict[str, torch.Tensor], model: nn.Module) -> str | None:
    """What differs between rank 0's full state dict and the sharded model's (global) tensors:
    names, shapes or dtypes; None when they agree."""
    ours = model.state_dict()
    if set(full) != set(ours):
        extra, missing = sorted(set(full) - set(ours)), sorted(set(ours) - set(full))
        return f"tensors only in the built model {extra[:3]}, only in the meta model {missing[:3]}"
    for key, value in ours.items():
        shape = tuple(value.shape)  # a DTensor's shape is the global one
        if (tuple(full[key].shape), full[key].dtype) != (shape, value.dtype):
            return (f"{key}: built {tuple(full[key].shape)} {full[key].dtype}, meta model "
                    f"{shape} {value.dtype}")
    return None


def _build_plain(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` on the CPU with float32 as the default dtype, as the non-sharded path builds
    (Lightning's ``configure_model`` may run under a precision's default dtype)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"):
            return build()
    finally:
        torch.set_default_dtype(default)


@torch.no_grad()
def materialize_sharded(model: nn.Module, device: torch.device) -> nn.Module:
    """Allocate and fill a meta-device model sharded by :func:`shard_model`, in place.

    Every rank allocates only its own shards on ``device`` (``to_empty``: the decoder layers'
    and the root's parameters are FSDP2 ``DTensor`` shards, 1/W of each tensor) and ties the
    tied parameters again. Rank 0 alone builds the full model on the CPU (the callable
    :func:`defer_weights` attached: the very build of the non-sharded path, so the weights are
    the same, pretrained or random with the same seed). Its parameters are then broadcast one
    at a time; each rank keeps its shard of each (what ``set_model_state_dict(...,
    full_state_dict=True, broadcast_from_rank0=True)`` does) and rank 0 drops each full tensor
    once sent. Buffers (persistent or not: rotary ``inv_freq``) are not sharded: rank 0's are
    broadcast whole. Host memory (measured, 2 gloo ranks, a bf16 safetensors folder): the
    other ranks grow by their shards plus one full tensor in flight (~0.6-0.7x the model's
    bytes); rank 0 by ~1.5-1.6x: its shards and every page of the folder's memory-mapped
    weights, which stay mapped until the whole model is dropped at the end (dropping one
    tensor does not unmap its pages). A model whose layout (names, shapes, dtypes)
    differs from rank 0's build raises ``ValueError`` on every rank. Needs an initialised
    process group (the one of the model's mesh).
    """
    import torch.distributed as dist

    build = getattr(model, FULL_MODEL_ATTR, None)
    if build is None:
        raise ValueError(f"{type(model).__name__} on the meta device has no weights to load "
                         "(build it with saopd.models.sharding.defer_weights)")
    pairs = tied_pairs(model)
    model.to_empty(device=device)
    _retie(model, pairs)
    full_model = _build_plain(build) if dist.get_rank() == 0 else None
    problem = [_layout_mismatch(full_model.state_dict(), model)
               if full_model is not None else None]
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise ValueError(f"the meta-device model does not match the built one: {problem[0]}")
    reference = dict(full_model.named_buffers()) if full_model is not None else {}
    for name, buffer in model.named_buffers():
        if full_model is not None:
            buffer.copy_(reference[name])
        dist.broadcast(buffer, src=0)
    del reference
    _scatter_parameters(model, full_model, device)
    del full_model
    delattr(model, FULL_MODEL_ATTR)
    return model


def _scatter_parameters(model: nn.Module, full_model: nn.Module | None,
                        device: torch.device) -> None:
    """Broadcast each of rank 0's ``full_model`` parameters (None on the other ranks) and keep
    this rank's shard of it in ``model``'s parameter of the same name; rank 0's full tensor is
    freed once sent."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, target in model.named_parameters():  # a tied parameter once, by its first name
        if full_model is not None:
            source = full_model.get_parameter(name)
            whole = source.detach().to(device)
            source.data = torch.empty(0, dtype=source.dtype)  # rank 0 frees it once sent
        else:
            whole = torch.empty(target.shape, dtype=target.dtype, device=device)
        dist.broadcast(whole, src=0)
        if isinstance(target, DTensor):
            whole = distribute_tensor(whole, target.device_mesh, target.placements,
                                      src_data_rank=None)  # this rank's chunk, no traffic
        target.copy_(whole)
        del whole


def mesh_device(mesh: Any) -> torch.device:
    """This rank's device of a ``DeviceMesh``: ``cuda:<current>`` (Lightning selected it for
    the rank) for a CUDA mesh, else the mesh's device type (``cpu`` under gloo)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)
