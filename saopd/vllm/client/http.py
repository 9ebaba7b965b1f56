"""JSON over HTTP with one server (a ``saopd-serve`` vLLM server): every error names the URL.

Plain ``urllib`` (no ``vllm`` and no HTTP library needed in the training environment), proxies
ignored (the servers are on the cluster's network). Used by the rollout servers' client
(:mod:`saopd.vllm.client.rollout`) and the teacher servers' (:mod:`saopd.vllm.client.teacher`),
each with its own error class (a :class:`ServerError`) and wording. Every request carries the
server's API key (``Authorization: Bearer``, :mod:`saopd.vllm.server.auth`) when there is one; the
key is never part of a message or a ``repr``. A 401 or 403 says how to pass the key; a server
that marked itself broken (a failed weight reload, :mod:`saopd.vllm.server.guard`) says to restart
it; both are raised at once by :meth:`JsonClient.wait_healthy` instead of waiting.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from typing import Any

from saopd.vllm.server.guard import BROKEN_HEADER

__all__ = ["JsonClient", "ServerError", "error_detail"]

_HEALTH_POLL_SECONDS = 0.5


class ServerError(OSError):
    """A server failed or answered something unusable; the message names it. An ``OSError``, so
    that ``saopd-train`` reports one at start-up as a one-line error.

    Attributes:
        http_status: the HTTP status it answered (None: no answer, or not an HTTP error).
        fatal: waiting cannot help (a wrong or missing key, a broken server).
    """

    http_status: int | None = None
    fatal: bool = False


def error_detail(err: urllib.error.HTTPError) -> str:
    """The useful part of an HTTP error's body (vLLM's ``{"error": {"message": ...}}``)."""
    try:
        raw = err.read()
    except OSError:
        return err.reason or ""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw[:300].decode(errors="replace") or str(err.reason)
    if isinstance(body, dict):
        inner = body.get("error", body.get("detail", body))
        if isinstance(inner, dict) and "message" in inner:
            return str(inner["message"])[:500]
        return str(inner)[:500]
    return str(body)[:300]


class JsonClient:
    """``call(method, path, body)`` -> the answer's JSON, with errors naming the server.

    Args:
        url: the server's base URL (``http://127.0.0.1:8000``; a trailing ``/`` is dropped).
        timeout: seconds a request may take (connect + answer).
        role: how messages name the server (``"rollout server"``, ``"teacher server"``).
        error: the exception class raised (a :class:`ServerError` subclass).
        request_option, startup_option: the config keys of the request and start-up timeouts,
            named in a timeout's message.
        api_key: the server's key (None: requests go without one).
        key_option: the config key of the key file, named in a 401's message.
    """

    def __init__(self, url: str, timeout: float, *, role: str, error: type[ServerError],
                 request_option: str, startup_option: str, api_key: str | None = None,
                 key_option: str = "api_key_file") -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"{role} URL {url!r} is not an http(s) URL")
        self.url = url.rstrip("/")
        self.timeout = float(timeout)
        self.role, self.error = role, error
        self.request_option, self.startup_option = request_option, startup_option
        self.key_option = key_option
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def call(self, method: str, path: str, body: Any = None, *,
             timeout: float | None = None) -> Any:
        """``method path`` with ``body`` as JSON; the answer's JSON (None for an empty body).

        Raises :attr:`error` naming the URL when the server cannot be reached, does not answer in
        time, answers an HTTP error or answers something that is not JSON.
        """
        data = None if body is None else json.dumps(body).encode()
        headers = dict(self._headers)
        if data is not None:
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers=headers)
        limit = self.timeout if timeout is None else timeout
        where = f"{self.role} {self.url}: {method} {path}"
        try:
            with self._opener.open(request, timeout=limit) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            raise self._http_error(where, err) from None
        except (TimeoutError, urllib.error.URLError, OSError, http.client.HTTPException) as err:
            reason = getattr(err, "reason", None) or err
            if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                raise self.error(
                    f"{where} got no answer within {limit:g} s ({self.request_option} / "
                    f"{self.startup_option}); is the server overloaded or stuck?") from None
            raise self.error(
                f"{where} failed ({type(reason).__name__}: {reason}); is the {self.role} "
                "running (saopd-serve) and reachable from this machine?") from None
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise self.error(
                f"{where} answered something that is not JSON ({raw[:200]!r}); is this a "
                "saopd-serve (vLLM) server?") from None

    def _http_error(self, where: str, err: urllib.error.HTTPError) -> ServerError:
        """The error for an HTTP error answer: how to pass the key for 401/403, to restart a
        broken server."""
        detail = error_detail(err)
        if err.code == 401:
            hint = ("it needs saopd-serve's API key, which this client "
                    + ("sent but the server does not accept" if self._headers else "lacks")
                    + f": set SAOPD_SERVE_API_KEY or {self.key_option}=<the key file "
                    "saopd-serve printed at start-up>")
            exc = self.error(f"{where} answered HTTP 401 (unauthorized): {hint}")
        else:
            exc = self.error(f"{where} answered HTTP {err.code}: {detail}")
        exc.http_status = err.code
        exc.fatal = err.code in (401, 403) or bool(
            err.headers is not None and err.headers.get(BROKEN_HEADER))
        return exc

    def garbage(self, path: str, what: str, got: Any) -> OSError:
        """The error for an answer of the wrong shape (to raise)."""
        text = repr(got)
        if len(text) > 200:
            text = text[:200] + "..."
        return self.error(f"{self.role} {self.url}: {path} answered {text}, not {what}; is this "
                          "a saopd-serve (vLLM) server?")

    def rpc(self, method: str, *args: Any) -> Any:
        """The first worker's result of ``POST /collective_rpc`` ``method(*args)`` (the
        endpoint of ``VLLM_SERVER_DEV_MODE=1``; a saopd worker-extension method, which must
        answer a JSON object)."""
        try:
            got = self.call("POST", "/collective_rpc", {"method": method, "args": list(args)})
        except self.error as err:
            text = str(err)
            if err.http_status == 404:
                raise self.error(
                    f"{self.role} {self.url} has no /collective_rpc (vLLM's dev mode): start "
                    "it with saopd-serve, which sets VLLM_SERVER_DEV_MODE=1 and saopd's worker "
                    "extension") from None
            if method in text and ("has no attribute" in text or "not found" in text):
                raise self.error(
                    f"{self.role} {self.url} has no worker method {method!r}: start it with "
                    f"saopd-serve (saopd's worker extension) from this saopd version ({text})"
                ) from None
            raise
        results = got.get("results") if isinstance(got, dict) else None
        if not isinstance(results, list) or not results or not isinstance(results[0], dict):
            raise self.garbage(f"/collective_rpc {method}", "a JSON object per worker", got)
        return results[0]

    def health(self, *, timeout: float | None = None) -> None:
        """``GET /health``; :attr:`error` unless it answers 200."""
        self.call("GET", "/health", timeout=timeout)

    def wait_healthy(self, deadline: float) -> None:
        """Poll ``/health`` until it answers 200; :attr:`error` naming the URL and the last
        failure once ``deadline`` (``time.monotonic()``) has passed, at once for a
        :attr:`ServerError.fatal` one (a refused key, a broken server)."""
        while True:
            left = deadline - time.monotonic()
            try:
                self.health(timeout=max(0.1, min(left, 10.0)))
                return
            except self.error as err:
                if err.fatal:
                    raise
                if time.monotonic() + _HEALTH_POLL_SECONDS >= deadline:
                    raise self.error(
                        f"{self.role} {self.url} was not healthy within the start-up timeout "
                        f"({self.startup_option}); last try: {err}") from None
            time.sleep(_HEALTH_POLL_SECONDS)
