"""JSON over HTTP with one server (a ``saopd-serve`` vLLM server): every error names the URL.

Plain ``urllib`` (no ``vllm`` and no HTTP library needed in the training environment), proxies
ignored (the servers are on the cluster's network). Used by the rollout servers' client
(:mod:`saopd.rollout.vllm_server`) and the teacher servers' (:mod:`saopd.scoring.teacher_service`),
each with its own error class and wording.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from typing import Any

__all__ = ["JsonClient", "error_detail"]

_HEALTH_POLL_SECONDS = 0.5


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
        error: the exception class raised (an ``OSError`` subclass).
        request_option, startup_option: the config keys of the request and start-up timeouts,
            named in a timeout's message.
    """

    def __init__(self, url: str, timeout: float, *, role: str, error: type[OSError],
                 request_option: str, startup_option: str) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"{role} URL {url!r} is not an http(s) URL")
        self.url = url.rstrip("/")
        self.timeout = float(timeout)
        self.role, self.error = role, error
        self.request_option, self.startup_option = request_option, startup_option
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
        headers = {"Content-Type": "application/json"} if data is not None else {}
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers=headers)
        limit = self.timeout if timeout is None else timeout
        where = f"{self.role} {self.url}: {method} {path}"
        try:
            with self._opener.open(request, timeout=limit) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            raise self.error(f"{where} answered HTTP {err.code}: {error_detail(err)}") from None
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

    def garbage(self, path: str, what: str, got: Any) -> OSError:
        """The error for an answer of the wrong shape (to raise)."""
        text = repr(got)
        if len(text) > 200:
            text = text[:200] + "..."
        return self.error(f"{self.role} {self.url}: {path} answered {text}, not {what}; is this "
                          "a saopd-serve (vLLM) server?")

    def health(self, *, timeout: float | None = None) -> None:
        """``GET /health``; :attr:`error` unless it answers 200."""
        self.call("GET", "/health", timeout=timeout)

    def wait_healthy(self, deadline: float) -> None:
        """Poll ``/health`` until it answers 200; :attr:`error` naming the URL and the last
        failure once ``deadline`` (``time.monotonic()``) has passed."""
        while True:
            left = deadline - time.monotonic()
            try:
                self.health(timeout=max(0.1, min(left, 10.0)))
                return
            except self.error as err:
                if time.monotonic() + _HEALTH_POLL_SECONDS >= deadline:
                    raise self.error(
                        f"{self.role} {self.url} was not healthy within the start-up timeout "
                        f"({self.startup_option}); last try: {err}") from None
            time.sleep(_HEALTH_POLL_SECONDS)
