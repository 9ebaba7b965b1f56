"""One rollout server (``rollout=vllm_server``): the client of a ``saopd-serve`` server and the
checks the engine runs through it (:class:`ServerClient`).

Start-up (:class:`~saopd.vllm.client.rollout.VLLMServerEngine`'s constructor, through
:func:`check_models` and the client's methods): ``GET /v1/models`` (the served model id:
``rollout.model``, or the first server's, the same on all; the smallest ``max_model_len``),
who the server is (``saopd_server_info``: the instance id and start time ``saopd-serve`` set,
the worker's pid and host, dtype, log-prob mode, model config, weights folder and whether a
reload broke it: :meth:`ServerClient.checked_info`, :meth:`ServerClient.check_config`), and
which of its tensors it stores under the checkpoint's names and shapes
(:meth:`ServerClient.comparable_names`). Each sync: the same server as at start-up
(:meth:`ServerClient.check_identity`; a restarted one serves its start-up weights), the probe
(:meth:`ServerClient.read_probe`), the reload (:meth:`ServerClient.reload`: refused with the
weights kept, or failed inside vLLM: restart), the prefix-cache reset and the sums
(:meth:`ServerClient.check_sums`).

Every failure names the server: one that is down or does not answer within
``request_timeout``, answers an HTTP error or something that is not the expected JSON, serves
another model, or restarted since start-up raises :class:`RolloutServerError`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from saopd.vllm.client.http import JsonClient, ServerError
from saopd.vllm.identity import config_differences, config_values

__all__ = ["RAW_LOGPROBS", "RolloutServerError", "ServerClient", "check_models", "json_number"]

#: The log-prob mode the servers must run (vLLM's default): log-probs of the raw logits.
RAW_LOGPROBS = "raw_logprobs"


class RolloutServerError(ServerError):
    """A rollout server is unreachable, restarted, serves another model or answered something
    saopd cannot use; the message names its URL. An ``OSError``, so that ``saopd-train``
    reports one at start-up as a one-line error."""


class ServerClient(JsonClient):
    """JSON over HTTP with one ``saopd-serve`` server (:class:`saopd.vllm.client.http.JsonClient`
    raising :class:`RolloutServerError`, every error naming the URL), and the calls the rollout
    engine makes.

    Args:
        url: the server's base URL (``http://127.0.0.1:8000``; a trailing ``/`` is dropped).
        timeout: seconds a request may take (connect + answer).
        api_key: the server's API key (None: sent without one).
    """

    def __init__(self, url: str, timeout: float, api_key: str | None = None) -> None:
        super().__init__(url, timeout, role="rollout server", error=RolloutServerError,
                         request_option="rollout.request_timeout",
                         startup_option="rollout.startup_timeout", api_key=api_key,
                         key_option="rollout.api_key_file")

    def models(self) -> list[dict[str, Any]]:
        """The model cards of ``GET /v1/models`` (each with a string ``id``)."""
        got = self.call("GET", "/v1/models")
        data = got.get("data") if isinstance(got, dict) else None
        if not isinstance(data, list) or not data or not all(
                isinstance(card, dict) and isinstance(card.get("id"), str) for card in data):
            raise self.garbage("/v1/models", "a list of models", got)
        return data

    def reset_prefix_cache(self, attempts: int = 20) -> None:
        """``POST /reset_prefix_cache``, retried while the server says it could not (blocks
        still held by running requests); ``RolloutServerError`` if it never succeeds."""
        got: Any = None
        for attempt in range(attempts):
            got = self.call("POST", "/reset_prefix_cache")
            if not isinstance(got, dict) or not isinstance(got.get("success"), bool):
                raise self.garbage("/reset_prefix_cache", '{"success": <bool>}', got)
            if got["success"]:
                return
            time.sleep(min(0.05 * 2 ** attempt, 1.0))
        raise RolloutServerError(
            f"rollout server {self.url} could not reset its prefix cache ({attempts} tries; "
            "requests still running?): its cached blocks hold the old weights' keys/values")

    def complete(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """``POST /v1/completions`` with ``body``; the answer (a JSON object with choices)."""
        got = self.call("POST", "/v1/completions", dict(body))
        if not isinstance(got, dict) or not isinstance(got.get("choices"), list):
            raise self.garbage("/v1/completions", "a completion with choices", got)
        return got

    def checked_info(self, weights_dir: Path) -> dict[str, Any]:
        """The server's ``saopd_server_info``, checked: its shape, a torch dtype, the raw
        log-prob mode, not broken, and ``weights_dir`` (the run's, resolved) as its weights
        folder."""
        info = self.rpc("saopd_server_info")
        fields = {"instance": str, "pid": int, "dtype": str, "config": dict, "weights_dir": str}
        if not all(isinstance(info.get(k), t) for k, t in fields.items()):
            raise self.garbage("/collective_rpc saopd_server_info",
                               "instance, pid, dtype, config and weights_dir (a saopd-serve "
                               "of this saopd version)", info)
        if info.get("broken"):
            raise RolloutServerError(
                f"rollout server {self.url}: a weight reload failed there earlier "
                f"({info['broken']}); its weights are unknown: restart it (saopd-serve)")
        if Path(info["weights_dir"]) != weights_dir:
            raise RolloutServerError(
                f"rollout server {self.url} reads weights only under its --weights-dir "
                f"{info['weights_dir']}; this run writes them under {weights_dir} "
                f"(rollout.weights_dir): start saopd-serve with --weights-dir {weights_dir} or "
                f"set rollout.weights_dir={info['weights_dir']}")
        if not hasattr(torch, info["dtype"]) or not isinstance(
                getattr(torch, info["dtype"]), torch.dtype):
            raise self.garbage("/collective_rpc saopd_server_info", "a torch dtype",
                               info["dtype"])
        mode = info.get("logprobs_mode")
        if mode is not None and mode != RAW_LOGPROBS:
            raise RolloutServerError(
                f"rollout server {self.url} reports {mode} log-probs; saopd needs the raw "
                f"sampler log-probs (vLLM's default --logprobs-mode {RAW_LOGPROBS})")
        return info

    def check_config(self, info: Mapping[str, Any], model: str,
                     model_config: Any | None) -> None:
        """The served model's config (``info``'s) agrees with the student's on
        :data:`~saopd.vllm.identity.CONFIG_KEYS` (None: not compared)."""
        if model_config is None:
            return
        differ = config_differences(info["config"], config_values(model_config), "student")
        if differ:
            raise RolloutServerError(
                f"rollout server {self.url} serves {model!r}, a model that differs from "
                f"the student: {', '.join(differ)}; serve a copy of the student "
                "(save_pretrained) with saopd-serve --model")

    def comparable_names(self, expected: Mapping[str, tuple[int, ...]], model: str
                         ) -> tuple[dict[str, str], dict[str, int]]:
        """HF name -> the server's name of the tensors of ``expected`` it stores under the same
        shape, or padded along the vocabulary (what the sync check compares), and served name
        -> rows compared of the padded ones; ``RolloutServerError`` when a norm of another
        shape shows that it serves another model."""
        got = self.rpc("saopd_server_shapes", sorted(expected))
        shapes, mapped = got.get("shapes"), got.get("names")
        if not isinstance(shapes, dict) or not isinstance(mapped, dict):
            raise self.garbage("/collective_rpc saopd_server_shapes", "shapes and names", got)
        names: dict[str, str] = {}
        rows: dict[str, int] = {}
        wrong = []
        for hf, shape in expected.items():
            name = mapped.get(hf)
            if not isinstance(name, str) or name not in shapes:
                continue  # fused or renamed by the model's loader: not comparable
            served = tuple(shapes[name]) if isinstance(shapes[name], list) else None
            if served == shape:
                names[hf] = name
            elif (served is not None and len(served) == len(shape) >= 2
                  and served[1:] == shape[1:] and served[0] > shape[0]):
                names[hf] = name  # a vocabulary vLLM padded: its first rows are compared
                rows[name] = shape[0]
            elif hf.endswith("norm.weight") and served is not None:
                # (an embedding may be padded: vLLM pads the vocabulary; norms are not)
                wrong.append(f"{hf}: {served} (student: {shape})")
        if wrong:
            raise RolloutServerError(
                f"rollout server {self.url} serves {model!r}, whose weights do not fit "
                f"the student's: {wrong[:3]}")
        return names, rows

    def check_identity(self, then: tuple[str, int]) -> None:
        """``RolloutServerError`` when the server is not the one met at start-up (``then``: its
        instance id and worker pid)."""
        info = self.rpc("saopd_server_info")
        now = (info.get("instance"), info.get("pid"))
        if now != then:
            started = json_number(info.get("started"))
            when = (time.strftime(" at %H:%M:%S", time.localtime(started))
                    if math.isfinite(started) and started > 0 else "")
            raise RolloutServerError(
                f"rollout server {self.url} restarted{when} (instance {then[0][:8]} pid "
                f"{then[1]} at start-up, now {str(now[0])[:8]} pid {now[1]}): it serves its "
                "start-up weights, not the student's; the run stops (restart it with "
                "resume=auto)")

    def read_probe(self, folder: Path, digest: str) -> None:
        """``RolloutServerError`` unless the server answers ``digest`` for the probe file of
        ``folder`` (it cannot see the folder otherwise)."""
        got = self.rpc("saopd_server_read_probe", str(folder))
        if got.get("sha256") != digest:
            raise RolloutServerError(
                f"rollout server {self.url} cannot read the weights folder {folder} "
                f"that global rank 0 writes ({got.get('error') or 'another file'}): "
                "rollout.weights_dir must be a folder every server sees (one node: "
                "/dev/shm; several nodes: a shared file system)")

    def reload(self, folder: Path) -> dict[str, Any]:
        """``saopd_server_reload`` of ``folder``; a refusal (weights kept) and a failure inside
        vLLM (weights partly replaced: restart) each get their message."""
        try:
            got = self.rpc("saopd_server_reload", str(folder))
        except RolloutServerError as err:
            if err.http_status is not None and err.http_status >= 500 and not err.fatal:
                raise RolloutServerError(
                    f"rollout server {self.url}: the weight reload from {folder} failed "
                    f"inside vLLM ({err}); its weights are now partly replaced and it has "
                    "marked itself unhealthy: restart it (saopd-serve), then resume the run "
                    "(resume=auto)") from None
            raise
        if "refused" in got:
            raise RolloutServerError(
                f"rollout server {self.url} refused to reload {folder}: {got['refused']} "
                "(it keeps its previous weights)")
        if not isinstance(got.get("repacked"), int):
            raise self.garbage("/collective_rpc saopd_server_reload", '{"repacked": <int>}',
                               got)
        return got

    def check_sums(self, sums: Mapping[str, float], served_names: Mapping[str, str],
                   rows: Mapping[str, int]) -> int:
        """Compare the server's float64 sums of the tensors ``served_names`` maps the names of
        ``sums`` to (over their first ``rows`` rows where given) with ``sums`` (what was sent);
        returns how many tensors were compared, ``RuntimeError`` naming the server on a
        mismatch or a stale packed head."""
        names = sorted(sums)
        served = [served_names[n] for n in names]
        got = self.rpc("saopd_server_sync_check", served,
                       {n: r for n, r in rows.items() if n in served})
        have, stale = got.get("sums"), got.get("stale")
        if not isinstance(have, dict) or not isinstance(stale, list):
            raise self.garbage("/collective_rpc saopd_server_sync_check",
                               "sums and stale modules", got)
        values = {n: json_number(have.get(v)) for n, v in zip(names, served, strict=True)}
        wrong = [f"{n}: sent sum {sums[n]:.6g}, server has {values[n]:.6g}" for n in names
                 if not math.isclose(sums[n], values[n], rel_tol=1e-6, abs_tol=1e-4)]
        wrong += [f"{n}: its packed GEMM weight no longer matches its weight" for n in stale]
        if wrong:
            raise RuntimeError(f"rollout server {self.url}: weight sync check failed "
                               f"({len(wrong)} of {len(names) + len(stale)} checks) after "
                               f"reload: {wrong[:3]}")
        return len(names)


def check_models(clients: Sequence[ServerClient], model: str | None) -> tuple[str, int]:
    """The served model id every server lists (``model``, or the first server's first one)
    and the smallest ``max_model_len``."""
    want = model
    lengths = []
    for client in clients:
        cards = client.models()
        ids = [card["id"] for card in cards]
        if want is None:
            want = ids[0]
        card = next((c for c in cards if c["id"] == want), None)
        if card is None:
            source = "rollout.model" if model is not None else clients[0].url
            raise RolloutServerError(
                f"rollout server {client.url} serves {ids}, not {want!r} ({source}): it "
                "serves another model")
        length = card.get("max_model_len")
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise client.garbage("/v1/models", "a model card with max_model_len", card)
        lengths.append(length)
    assert want is not None
    return want, min(lengths)


def json_number(value: Any) -> float:
    """A JSON number, or a non-finite float sent as a string; NaN for anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return float(value)
    return math.nan
