"""Layer pruning of a decoder-only model (a weaker student: keep every k-th decoder layer, or an
explicit list), and where a model keeps its decoder stack.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["decoder_stack", "prune_indices", "prune_layers"]


def decoder_stack(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
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


def prune_indices(n: int, keep: Sequence[int] | None, every: int | None) -> list[int]:
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
    owner, attr, layers = decoder_stack(model)
    n = len(layers)
    kept = prune_indices(n, keep, every)
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
