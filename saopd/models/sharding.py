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

from collections.abc import Iterator
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
