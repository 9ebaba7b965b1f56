"""The ASGI middleware ``saopd-serve`` puts in front of vLLM's whole server (``--middleware
saopd.vllm.server.guard.SaopdServeGuard``; vLLM adds it last, so it sees every request first).

vLLM's own ``--api-key`` check covers the paths under ``/v1``, ``/v2``, ``/inference`` and
``/cohere`` only (vllm 0.32, ``entrypoints/serve/middleware/authenticate.py``): the dev-mode
endpoints saopd needs (``/collective_rpc``, which runs worker methods by name, and
``/reset_prefix_cache``), ``/tokenize``, ``/health``, ``/metrics`` and the rest stay open. This
guard, for every HTTP request and WebSocket of every path:

1. **401** unless it carries ``Authorization: Bearer <key>`` with the server's key
   (``SAOPD_SERVE_API_KEY`` in the server's environment, :mod:`saopd.vllm.server.auth`; compared as
   SHA-256 digests in constant time). The guard refuses to start without a key.
2. **403** for the endpoints that change the weights from outside saopd's weights folder
   (:data:`BLOCKED_PATHS`: vLLM's RL weight-transfer routes) and, on ``/collective_rpc``, for
   any worker method but saopd's own (``saopd_server_*``): vLLM's ``reload_weights`` or
   ``save_sharded_state`` would read or write any path.
3. **503** for every request once a weight reload failed inside vLLM (``saopd_server_reload``
   answered an error): vLLM reloads layer by layer, so the served weights are then partly
   replaced; ``/health`` fails too, and every answer says to restart the server.

Pure ASGI, standard library only (it runs inside vLLM's server).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from saopd.vllm.server.auth import API_KEY_ENV

__all__ = ["BLOCKED_PATHS", "BROKEN_HEADER", "RPC_PREFIX", "SaopdServeGuard"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: The worker methods ``/collective_rpc`` may run (saopd's worker extension).
RPC_PREFIX = "saopd_server_"
#: The method whose failure inside vLLM leaves the weights partly replaced.
RELOAD_METHOD = "saopd_server_reload"
#: Routes of vLLM's dev mode that change the served weights by other means than saopd's reload.
BLOCKED_PATHS = frozenset({
    "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine", "/start_weight_update",
    "/start_draft_weight_update", "/update_weights", "/finish_weight_update",
    "/update_weight_version",
})
#: A response header marking the answers of a server whose weights are unknown.
BROKEN_HEADER = "x-saopd-serve-broken"
_MAX_RPC_BODY = 1 << 20


def _json_error(status: int, message: str) -> bytes:
    kind = {401: "Unauthorized", 403: "Forbidden", 413: "TooLarge",
            503: "ServiceUnavailable"}.get(status, "Error")
    return json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()


class SaopdServeGuard:
    """The middleware (module docstring). ``app``: the ASGI app it guards.

    Attributes:
        broken: why the server's weights are unknown (a failed reload), None while they are not.
    """

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        key = os.environ.get(API_KEY_ENV, "")
        if not key:
            raise RuntimeError(f"SaopdServeGuard needs the server's API key in {API_KEY_ENV} "
                               "(start the server with saopd-serve)")
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()
        self.broken: str | None = None

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    given = hashlib.sha256(token.strip().encode()).digest()
                    return hmac.compare_digest(given, self._digest)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        if not self._authorized(scope):
            await _refuse(scope, receive, send, 401,
                          "saopd-serve: this server needs its API key (Authorization: "
                          "Bearer <key>); saopd-serve printed the file it is in. Clients: "
                          f"set {API_KEY_ENV}, or rollout.api_key_file / "
                          "teacher_scoring.api_key_file")
            return
        if path in BLOCKED_PATHS:
            await _refuse(scope, receive, send, 403,
                          f"saopd-serve: {path} changes the served weights outside saopd's "
                          "weight sync; it is not served")
            return
        if self.broken is not None:
            await _refuse(scope, receive, send, 503, self.broken)
            return
        if path == "/collective_rpc" and scope["type"] == "http":
            await self._rpc(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _rpc(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``/collective_rpc``: saopd's worker methods only; a reload that fails inside vLLM
        marks the server broken."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > _MAX_RPC_BODY:
                await _refuse(scope, receive, send, 413,
                              "saopd-serve: /collective_rpc body too large")
                return
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        try:
            method = json.loads(body).get("method")
        except (ValueError, AttributeError):
            method = None
        if not isinstance(method, str) or not method.startswith(RPC_PREFIX):
            await _refuse(scope, receive, send, 403,
                          f"saopd-serve: /collective_rpc runs saopd's worker methods "
                          f"({RPC_PREFIX}*) only, not {method!r}")
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        status: list[int] = []
        answer: list[bytes] = []

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            elif message["type"] == "http.response.body" and sum(map(len, answer)) < 4096:
                answer.append(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, replay, watch)
        except Exception as err:
            if method == RELOAD_METHOD:
                self._mark_broken(f"{type(err).__name__}: {err}")
            raise
        if method == RELOAD_METHOD and (not status or status[0] >= 500):
            self._mark_broken(b"".join(answer)[:500].decode(errors="replace"))

    def _mark_broken(self, detail: str) -> None:
        self.broken = (
            f"saopd-serve: a weight reload failed inside vLLM at "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')} ({detail.strip() or 'no detail'}): vLLM "
            "reloads layer by layer, so this server's weights are now partly replaced and it "
            "answers nothing more; restart it (saopd-serve), then resume the run (resume=auto)")


async def _refuse(scope: Scope, receive: Receive, send: Send, status: int,
                  message: str) -> None:
    """Answer ``status`` with a JSON error (vLLM's shape), or refuse a WebSocket's handshake."""
    if scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
        return
    body = _json_error(status, message)
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if status == 503:
        headers.append((BROKEN_HEADER.encode(), b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
