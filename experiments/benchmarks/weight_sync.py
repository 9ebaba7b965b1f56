"""Benchmark: one weight sync of SmolLM2-135M-Instruct into vLLM, three ways, in one run.

- ``in_process``: :class:`~saopd.vllm.engine.VLLMEngine` with the engine core in this process,
  tensors handed to vLLM's ``reload_weights`` (the ``iterator`` transport);
- ``files``: the same engine with its core in a subprocess (what every rank of a colocated
  multi-process run uses): safetensors shards in ``/dev/shm``, reloaded from there;
- ``server``: :class:`~saopd.vllm.client.rollout.VLLMServerEngine` against a ``saopd-serve``
  server on 127.0.0.1 (rank 0 writes the shards to the weights folder, the server reloads them
  over ``/collective_rpc``, resets its prefix cache and is checked).

Each engine is started, synced once untimed (warm-up), then the syncs alternate between the
engines ``--repeat`` times (so machine drift hits all three); every sync sends the student's
weights after a small perturbation (so the engine really changes) and verifies it
(``verify_sync``). Reported: the median seconds per engine and their ratios, as JSON.

    .venv-vllm/bin/python experiments/benchmarks/weight_sync.py --repeat 3 \
        --out /tmp/weight_sync.json

Needs the vLLM venv (``make setup-vllm``); about 3-4 minutes on 2 CPU cores (three engine
start-ups).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_server(folder: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "saopd.serve", "--model", str(folder), "--port", str(port),
         "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory-bytes",
         str(1 << 30), "--enforce-eager"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"saopd-serve exited:\n{log.read_text()[-2000:]}") from None
            time.sleep(2)
    proc.kill()
    raise RuntimeError("saopd-serve did not become healthy in 600 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from saopd.models.loading import load_causal_lm, load_tokenizer
    from saopd.models.smollm2 import smollm2_135m_instruct
    from saopd.rollout.base import default_stop_token_ids
    from saopd.vllm.client.rollout import VLLMServerEngine
    from saopd.vllm.engine import VLLMEngine
    from saopd.vllm.sync import canonical_weight_name

    source = smollm2_135m_instruct()
    model = load_causal_lm(str(source), dtype="float32")
    tok = load_tokenizer(str(source))
    load = os.getloadavg()
    common = {"dtype": "float32", "kv_cache_gb": 0.5, "enforce_eager": True,
              "max_model_len": 1024}
    started: dict[str, float] = {}
    t = time.perf_counter()
    engines = {"in_process": VLLMEngine.from_model(model, tok, in_process=True, **common)}
    started["in_process"] = time.perf_counter() - t
    t = time.perf_counter()
    engines["files"] = VLLMEngine.from_model(model, tok, in_process=False, **common)
    started["files"] = time.perf_counter() - t
    folder = Path(tempfile.mkdtemp(prefix="saopd-bench-student-"))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    port = _free_port()
    t = time.perf_counter()
    server = _start_server(folder, port, folder / "serve.log")
    expected = {canonical_weight_name(n): tuple(p.shape) for n, p in model.named_parameters()}
    engines["server"] = VLLMServerEngine(
        [f"http://127.0.0.1:{port}"], tok, expected_weights=expected,
        stop_token_ids=default_stop_token_ids(tok, model), model_config=model.config)
    started["server"] = time.perf_counter() - t
    times: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for rnd in range(args.repeat + 1):
            for name, engine in engines.items():
                with torch.no_grad():  # a changed student each time
                    model.model.norm.weight.add_(1e-3)
                t = time.perf_counter()
                engine.load_weights(model.named_parameters())
                seconds = time.perf_counter() - t
                if rnd:  # round 0 is the warm-up
                    times[name].append(seconds)
    finally:
        for name in ("in_process", "files"):
            engines[name].close()
        server.terminate()
        server.wait(timeout=60)
    medians = {name: statistics.median(v) for name, v in times.items()}
    out = {
        "model": "SmolLM2-135M-Instruct float32", "parameters": sum(
            p.numel() for p in model.parameters()),
        "repeat": args.repeat, "seconds": times, "median_seconds": medians,
        "ratio_files_over_in_process": medians["files"] / medians["in_process"],
        "ratio_server_over_in_process": medians["server"] / medians["in_process"],
        "server_write_seconds": engines["server"].last_write_seconds,
        "server_reload_seconds": engines["server"].last_reload_seconds,
        "startup_seconds": started, "load_average_before": load,
        "load_average_after": os.getloadavg(), "torch": torch.__version__,
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
