"""rollout=vllm_server without vLLM: the client's protocol against a fake server on 127.0.0.1.

The fake (:class:`FakeServer`, ``http.server`` in a thread) answers the endpoints a
``saopd-serve`` server answers (``/health``, ``/v1/models``, ``/collective_rpc`` with saopd's
worker methods, ``/reset_prefix_cache``, ``/v1/completions``); it really reads the shards a sync
writes and sums them, so the sync check is exercised end to end. Any endpoint can be made to
answer garbage, an HTTP error, another model, a restart or nothing in time: every failure must
be a ``RolloutServerError`` naming the URL (never a hang). Also: the health wait times out, the
prompts are dealt out over two servers with per-prompt seeds, a 2-rank gloo run (DTensor shards)
syncs through rank 0 and a failure on rank 0 stops rank 1 too, the config and factory checks,
and ``saopd-serve``'s command line. The real server: tests/integration/vllm/test_vllm_server.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from saopd.config.rollout import VLLMServerRolloutConfig
from saopd.rollout import ENGINES, SamplingParams, build_engine
from saopd.vllm.client.rollout import VLLMServerEngine
from saopd.vllm.client.rollout_server import RolloutServerError, ServerClient
from saopd.vllm.server.cli import GUARD, build_command, weights_dir
from saopd.vllm.server.cli import main as serve_main
from saopd.vllm.worker import INSTANCE_ENV, PROBE_FILE, STARTED_ENV, WORKER_EXTENSION
from tests.helpers.net import free_port

CHATS = [[{"role": "user", "content": "Alice has 3 apples. How many?"}],
         [{"role": "user", "content": "hi"}],
         [{"role": "user", "content": "Please solve 12 * 7"}]]
STOP = 2  # the tiny tokenizer's <|im_end|>
PAD_ROWS = 7  # the fake pads the vocabulary as vLLM does


class FakeServer:
    """A fake saopd-serve server: answers like one; ``faults[path or rpc method]`` overrides
    an answer with ``(status, body)`` (body: JSON-able, or bytes sent as is) or a callable."""

    def __init__(self, params: dict[str, torch.Tensor], config: dict[str, Any] | None = None,
                 model: str = "student") -> None:
        self.served = {n: (torch.cat([t, torch.zeros(PAD_ROWS, *t.shape[1:])])
                           if n.endswith("embed_tokens.weight") else t.clone())
                       for n, t in params.items()}
        self.config = config or {}
        self.model = model
        # the folder it reloads from (saopd-serve --weights-dir): the engine's default parent
        self.weights_dir = str(weights_dir(None))
        self.instance, self.pid = "instance-a", 1234
        self.faults: dict[str, Any] = {}
        self.requests: list[tuple[str, Any]] = []
        self.reloads = self.resets = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                server.answer(self, None)

            def do_POST(self) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(size) if size else b""
                server.answer(self, json.loads(raw) if raw else None)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # ---- answers ----------------------------------------------------------------------------
    def answer(self, handler: BaseHTTPRequestHandler, body: Any) -> None:
        path = handler.path.split("?")[0]
        self.requests.append((path, body))
        method = body.get("method") if path == "/collective_rpc" and body else None
        fault = self.faults.get(path, self.faults.get(method))
        if callable(fault):
            fault = fault(body)
        status, out = fault if fault is not None else self.normal(path, body)
        data = out if isinstance(out, bytes) else json.dumps(out).encode()
        handler.send_response(status)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def normal(self, path: str, body: Any) -> tuple[int, Any]:
        if path == "/health":
            return 200, b""
        if path == "/v1/models":
            return 200, {"object": "list", "data": [
                {"id": self.model, "object": "model", "max_model_len": 512}]}
        if path == "/reset_prefix_cache":
            self.resets += 1
            return 200, {"success": True}
        if path == "/collective_rpc":
            return 200, {"results": [self.rpc(body["method"], *body.get("args", []))]}
        if path == "/v1/completions":
            n, ids = body["n"], body["prompt"]
            return 200, {"id": "cmpl-1", "model": body["model"], "choices": [
                {"index": j, "text": "", "token_ids": [5 + j, 6, STOP],
                 "prompt_token_ids": ids,
                 "logprobs": {"token_logprobs": [-1.0 - j, -2.0, -0.5]}}
                for j in range(n)]}
        return 404, {"detail": "Not Found"}

    def rpc(self, method: str, *args: Any) -> Any:
        if method == "saopd_server_info":
            return {"instance": self.instance, "started": 1.0e9, "pid": self.pid,
                    "host": "fake", "dtype": "float32", "logprobs_mode": "raw_logprobs",
                    "model": self.model, "config": self.config,
                    "weights_dir": self.weights_dir, "broken": None}
        if method == "saopd_server_shapes":
            return {"shapes": {n: list(t.shape) for n, t in self.served.items()},
                    "names": {n: n for n in args[0]}}
        if method == "saopd_server_read_probe":
            try:
                probe = (Path(args[0]) / PROBE_FILE).read_bytes()
            except OSError as err:
                return {"error": str(err)}
            return {"sha256": hashlib.sha256(probe).hexdigest()}
        if method == "saopd_server_reload":
            from safetensors.torch import load_file

            for file in sorted(Path(args[0]).glob("*.safetensors")):
                for name, tensor in load_file(str(file)).items():
                    self.served[name][: tensor.shape[0]] = tensor
            self.reloads += 1
            return {"repacked": 0}
        if method == "saopd_server_sync_check":
            names, rows = args[0], args[1] if len(args) > 1 else {}
            return {"sums": {n: float(self.served[n][: rows.get(n, None)].double().sum())
                             for n in names}, "stale": []}
        raise AssertionError(method)


def _student() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"model.embed_tokens.weight": torch.randn(10, 4, generator=gen),
            "model.layers.0.mlp.up_proj.weight": torch.randn(8, 4, generator=gen),
            "model.norm.weight": torch.randn(4, generator=gen)}


def _engine(urls: list[str], tok: Any, **kw: Any) -> VLLMServerEngine:
    params = _student()
    kw.setdefault("startup_timeout", 5.0)
    kw.setdefault("request_timeout", 5.0)
    return VLLMServerEngine(urls, tok, expected_weights={n: t.shape for n, t in params.items()},
                            stop_token_ids=[STOP], **kw)


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    server = FakeServer(_student())
    yield server
    server.stop()


@pytest.fixture
def engine(fake: FakeServer, tiny_tok: Any, tmp_path: Path) -> Iterator[VLLMServerEngine]:
    fake.weights_dir = str((tmp_path / "weights").resolve())
    eng = _engine([fake.url], tiny_tok, weights_dir=tmp_path / "weights")
    yield eng
    eng.close()


# ---- the happy path ------------------------------------------------------------------------
def test_engine_is_registered_and_the_schema_has_the_defaults() -> None:
    assert "vllm_server" in ENGINES.names()
    conf = VLLMServerRolloutConfig(urls=["http://127.0.0.1:8000"])
    assert conf.importance_ratio_cap == 5.0 and conf.weights_dir is None
    for kw, match in [({"urls": ["127.0.0.1:8000"]}, r"not an http\(s\) URL"),
                      ({"urls": ["http://a:1", "http://a:1/"]}, "more than once"),
                      ({"request_timeout": 0}, r"request_timeout must be a number > 0"),
                      ({"engine": "vllm"}, "rollout.engine is 'vllm_server'")]:
        with pytest.raises(ValueError, match=match):
            VLLMServerRolloutConfig(**kw)


def test_generate_sends_the_rendered_ids_with_per_prompt_seeds(fake, engine, tiny_tok) -> None:
    sampling = SamplingParams(n=2, temperature=0.7, top_p=0.9, max_new_tokens=5, seed=11)
    batch = engine.generate(CHATS, sampling)
    bodies = [b for p, b in fake.requests if p == "/v1/completions"]
    assert sorted(b["seed"] for b in bodies) == [11, 13, 15]  # seed + i * n
    for body in bodies:
        assert body["model"] == "student" and body["n"] == 2 and body["logprobs"] == 0
        assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"]) == (
            0.7, 0.9, 0, 0.0)
        assert body["stop_token_ids"] == [STOP] and body["return_token_ids"] is True
        assert body["max_tokens"] == 5
    assert [r.prompt_index for r in batch.rollouts] == [0, 0, 1, 1, 2, 2]
    for r in batch.rollouts:
        assert r.prompt_ids == engine.prompt_ids(CHATS[r.prompt_index])
        assert r.response_ids[-1] == STOP and r.finished
        assert r.sampler_logprobs[1:] == [-2.0, -0.5]
    assert engine.last_prompts_per_server == [3]


def test_prompt_limit_counts_and_max_model_len(fake, engine) -> None:
    lengths = [len(engine.prompt_ids(c)) for c in CHATS]
    engine.max_prompt_length, engine.prompt_truncation = min(lengths), "skip"
    batch = engine.generate(CHATS, SamplingParams(max_new_tokens=4))
    assert batch.num_skipped_prompts == sum(n > min(lengths) for n in lengths) > 0
    engine.prompt_truncation = "truncate"
    batch = engine.generate(CHATS, SamplingParams(max_new_tokens=4))
    assert batch.num_truncated_prompts > 0
    assert all(len(r.prompt_ids) == min(lengths) for r in batch.rollouts)
    with pytest.raises(ValueError, match=r"servers' max_model_len 512"):
        engine.generate(CHATS, SamplingParams(max_new_tokens=600))


def test_sync_writes_shards_reloads_resets_and_checks(fake, engine, tmp_path) -> None:
    new = {n: t + 1 for n, t in _student().items()}
    engine.load_weights(new.items())
    assert fake.reloads == 1 and fake.resets == 1
    # embedding (padded: first rows), norm and linear: the fake stores what was sent
    assert engine.last_sync_checked == 3 and engine._rows == {"model.embed_tokens.weight": 10}
    for name, tensor in new.items():
        assert torch.equal(fake.served[name][: tensor.shape[0]], tensor)
    folder = engine._sync_dir
    assert folder.parent == tmp_path / "weights"
    assert sorted(p.name for p in folder.iterdir()) == [  # the probe is gone
        ".saopd-owner.json", "model-00000.safetensors", "model.safetensors.index.json"]
    engine.load_weights(new.items())
    assert fake.reloads == 2 and engine.last_sync_seconds is not None
    engine.close()
    assert not folder.exists()


def test_bad_names_are_refused_before_anything_is_written(fake, engine) -> None:
    with pytest.raises(ValueError, match=r"1 missing: \['model\.norm\.weight'\]"):
        engine.load_weights((n, t) for n, t in _student().items() if n != "model.norm.weight")
    assert fake.reloads == 0


def test_a_sync_that_did_not_land_is_caught(fake, engine) -> None:
    fake.faults["saopd_server_reload"] = (200, {"results": [{"repacked": 0}]})  # ignores it
    with pytest.raises(RuntimeError, match=rf"rollout server {fake.url}: weight sync check "
                       r"failed .*model\.norm\.weight: sent sum"):
        engine.load_weights((n, t + 1) for n, t in _student().items())


def test_a_folder_the_server_cannot_read_is_named(fake, engine) -> None:
    fake.faults["saopd_server_read_probe"] = (200, {"results": [{"error": "No such file"}]})
    with pytest.raises(RolloutServerError, match=rf"{fake.url} cannot read the weights folder "
                       r".*No such file.*rollout.weights_dir"):
        engine.load_weights(_student().items())


# ---- servers that fail ---------------------------------------------------------------------
def test_health_wait_times_out_naming_the_url(tiny_tok) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens
    started = time.monotonic()
    with pytest.raises(RolloutServerError, match=rf"rollout server {url} was not healthy within "
                       r"the start-up timeout .*ConnectionRefusedError"):
        _engine([url], tiny_tok, startup_timeout=1.0)
    assert time.monotonic() - started < 10


def test_an_unhealthy_server_times_out_with_its_status(fake, tiny_tok) -> None:
    fake.faults["/health"] = (503, b"")
    with pytest.raises(RolloutServerError, match=rf"{fake.url} was not healthy.*HTTP 503"):
        _engine([fake.url], tiny_tok, startup_timeout=1.0)


@pytest.mark.parametrize(("path", "answer", "match"), [
    ("/v1/models", (200, b"<html>hello</html>"), r"/v1/models answered something that is not "
     r"JSON \(b'<html>hello</html>'\)"),
    ("/v1/models", (200, {"data": "x"}), r"/v1/models answered .*not a list of models"),
    ("/v1/models", (500, {"error": {"message": "boom"}}), r"/v1/models answered HTTP 500: boom"),
    ("/collective_rpc", (404, {"detail": "Not Found"}), r"has no /collective_rpc .*saopd-serve"),
    ("saopd_server_info", (500, {"error": {"message": "Worker failed with error "
                                           "'CPUWorker' object has no attribute "
                                           "'saopd_server_info'"}}),
     r"has no worker method 'saopd_server_info'"),
    ("saopd_server_info", (200, {"results": ["oops"]}), r"not a JSON object per worker"),
    ("saopd_server_info", (200, {"results": [{"instance": "a"}]}),
     r"not instance, pid, dtype, config and weights_dir"),
])
def test_garbage_at_start_up_names_the_url(fake, tiny_tok, path, answer, match) -> None:
    fake.faults[path] = answer
    with pytest.raises(RolloutServerError, match=rf"rollout server {fake.url}.*{match}"):
        _engine([fake.url], tiny_tok)


def test_another_model_is_refused(fake, tiny_tok) -> None:
    with pytest.raises(RolloutServerError, match=rf"{fake.url} serves \['student'\], not "
                       r"'teacher' \(rollout.model\): it serves another model"):
        _engine([fake.url], tiny_tok, model="teacher")
    fake.config = {"num_hidden_layers": 2, "hidden_size": 4}

    class Config:
        num_hidden_layers, hidden_size = 3, 4

    with pytest.raises(RolloutServerError, match=r"a model that differs from the student: "
                       r"num_hidden_layers 2 \(student: 3\)"):
        _engine([fake.url], tiny_tok, model_config=Config())
    fake.served["model.norm.weight"] = torch.ones(5)
    with pytest.raises(RolloutServerError, match=r"do not fit the student's.*model\.norm"):
        _engine([fake.url], tiny_tok)
    fake.faults["saopd_server_info"] = (200, {"results": [{
        "instance": "a", "pid": 1, "dtype": "float32", "config": {},
        "weights_dir": fake.weights_dir, "logprobs_mode": "processed_logprobs"}]})
    with pytest.raises(RolloutServerError, match=r"reports processed_logprobs log-probs"):
        _engine([fake.url], tiny_tok)


@pytest.mark.parametrize(("answer", "match"), [
    ((500, {"error": {"message": "EngineCore died"}}), r"answered HTTP 500: EngineCore died"),
    ((200, b"not json"), r"not JSON"),
    ((200, {"choices": [{"index": 0, "text": "hi"}]}), r"not 2 choices indexed 0\.\.1"),
    ((200, {"choices": [{"index": 0, "text": "hi"}, {"index": 1, "text": "hi"}]}),
     r"not response token ids with one log-prob each"),
    (lambda body: (200, {"choices": [{"index": j, "token_ids": [5], "prompt_token_ids": [1],
                                      "logprobs": {"token_logprobs": [-1.0]}}
                                     for j in range(body["n"])]}),
     r"sampled prompt 0 from other prompt ids"),
])
def test_bad_completions_name_the_url(fake, engine, answer, match) -> None:
    fake.faults["/v1/completions"] = answer
    with pytest.raises(RolloutServerError, match=rf"rollout server {fake.url}.*{match}"):
        engine.generate(CHATS[:1], SamplingParams(n=2, max_new_tokens=4))


def test_non_finite_logprobs_are_refused(fake, engine) -> None:
    fake.faults["/v1/completions"] = lambda body: (200, {"choices": [
        {"index": 0, "token_ids": [5], "logprobs": {"token_logprobs": ["NaN"]}}]})
    with pytest.raises(RuntimeError, match=rf"{fake.url} returned non-finite sampled-token"):
        engine.generate(CHATS[:1], SamplingParams(max_new_tokens=4))


def test_a_restarted_server_stops_the_run(fake, engine) -> None:
    engine.generate(CHATS[:1], SamplingParams(max_new_tokens=4))
    fake.instance = "instance-b"
    for call in (lambda: engine.generate(CHATS[:1], SamplingParams(max_new_tokens=4)),
                 lambda: engine.load_weights(_student().items())):
        with pytest.raises(RolloutServerError, match=rf"rollout server {fake.url} restarted at "
                           r".*instance instance.*it serves its start-up weights"):
            call()
    assert fake.reloads == 0


def test_a_server_that_goes_down_or_hangs_is_named(fake, engine) -> None:
    fake.faults["/v1/completions"] = lambda body: time.sleep(3) or (200, {})
    engine.clients[0].timeout = 0.5
    started = time.monotonic()
    with pytest.raises(RolloutServerError, match=rf"{fake.url}: POST /v1/completions got no "
                       r"answer within 0\.5 s"):
        engine.generate(CHATS[:1], SamplingParams(max_new_tokens=4))
    assert time.monotonic() - started < 3
    fake.stop()
    with pytest.raises(RolloutServerError, match=rf"rollout server {fake.url}: POST "
                       r"/collective_rpc failed \(ConnectionRefusedError.*is the rollout server "
                       r"running"):
        engine.generate(CHATS[:1], SamplingParams(max_new_tokens=4))


def test_prefix_cache_reset_is_retried_then_refused(fake, engine, monkeypatch) -> None:
    answers = iter([{"success": False}, {"success": True}])
    fake.faults["/reset_prefix_cache"] = lambda body: (200, next(answers))
    engine.load_weights(_student().items())
    fake.faults["/reset_prefix_cache"] = (200, {"success": False})
    monkeypatch.setattr("saopd.vllm.client.rollout.time.sleep", lambda s: None)
    with pytest.raises(RolloutServerError, match=rf"{fake.url} could not reset its prefix cache"):
        engine.load_weights(_student().items())


# ---- several servers -------------------------------------------------------------------------
def test_two_servers_share_the_prompts(tiny_tok, tmp_path) -> None:
    a, b = FakeServer(_student()), FakeServer(_student())
    try:
        a.weights_dir = b.weights_dir = str(tmp_path.resolve())
        with _engine([a.url, b.url], tiny_tok, weights_dir=tmp_path) as eng:
            batch = eng.generate(CHATS, SamplingParams(n=2, max_new_tokens=4, seed=0))
            assert eng.last_prompts_per_server == [2, 1]
            seeds = {s.url: sorted(body["seed"] for p, body in s.requests
                                   if p == "/v1/completions") for s in (a, b)}
            assert seeds == {a.url: [0, 4], b.url: [2]}  # prompts 0, 2 and 1; seed + i * n
            assert [r.prompt_index for r in batch.rollouts] == [0, 0, 1, 1, 2, 2]
            eng.load_weights((n, t * 2) for n, t in _student().items())
            assert (a.reloads, b.reloads) == (1, 1)
            b.instance = "other"
            with pytest.raises(RolloutServerError, match=rf"{b.url} restarted"):
                eng.load_weights(_student().items())
        b.model = "other-model"
        with pytest.raises(RolloutServerError, match=rf"{b.url} serves \['other-model'\], "
                           rf"not 'student' \({a.url}\)"):
            _engine([a.url, b.url], tiny_tok)
    finally:
        a.stop()
        b.stop()


def _two_rank_worker(rank: int, port: int, url: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from saopd.models.tiny import tiny_tokenizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    result: dict[str, Any] = {}
    try:
        mesh = init_device_mesh("cpu", (2,))
        full = {n: t * 3 for n, t in _student().items()}
        named = [(n, distribute_tensor(t, mesh, [Shard(0)])) for n, t in full.items()]
        engine = _engine([url], tiny_tokenizer(), weights_dir=Path(out).parent / "w")
        engine.load_weights(named)  # rank 0 writes the gathered tensors; rank 1 drains
        result["synced"] = engine.last_sync_seconds is not None
        result["checked"] = engine.last_sync_checked
        try:
            engine.load_weights(named)  # the fake now answers garbage to the reload
        except Exception as err:
            result["error"] = f"{type(err).__name__}: {err}"
        engine.close()
    finally:
        Path(f"{out}.{rank}").write_text(json.dumps(result))
        dist.destroy_process_group()


def test_two_ranks_sync_through_rank_0_and_share_its_failure(tmp_path) -> None:
    fake = FakeServer(_student())
    fake.weights_dir = str((tmp_path / "w").resolve())
    reloads = iter([None, (200, {"results": ["garbage"]})])
    fake.faults["saopd_server_reload"] = lambda body: next(reloads)
    try:
        out = str(tmp_path / "out")
        ctx = mp.start_processes(_two_rank_worker, args=(free_port(), fake.url, out), nprocs=2,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + 120
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "the ranks hang"
    finally:
        fake.stop()
    r0, r1 = (json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1))
    assert fake.reloads == 1  # once: by rank 0 only
    for name, tensor in _student().items():  # the full (gathered) tensors reached the server
        assert torch.equal(fake.served[name][: tensor.shape[0]], tensor * 3)
    assert r0["synced"] and r1["synced"] and r0["checked"] == 3
    assert r0["error"].startswith("RolloutServerError: rollout server") and "garbage" in r0["error"]
    assert r1["error"].startswith("RolloutServerError: the weight sync of global rank 0 failed: "
                                  "RolloutServerError: rollout server")


# ---- the factory and saopd-serve -------------------------------------------------------------
def test_factory_refusals(tiny_tok) -> None:
    from saopd.models.tiny import tiny_qwen3

    student = tiny_qwen3(tiny_tok)
    with pytest.raises(ValueError, match=r"rollout.urls must list at least one server"):
        build_engine(VLLMServerRolloutConfig(), student, tiny_tok)
    with pytest.raises(ValueError, match=r"text only for now; a vision-language student"):
        build_engine(VLLMServerRolloutConfig(urls=["http://127.0.0.1:1"]), student, tiny_tok,
                     processor=object())
    with pytest.raises(ValueError, match="not an http"):
        ServerClient("ftp://x", 1.0)


def test_build_engine_passes_the_config_to_the_engine(fake, tiny_tok, tmp_path) -> None:
    from saopd.models.tiny import tiny_qwen3

    student = tiny_qwen3(tiny_tok)
    fake.served = {n: p.detach().clone() for n, p in student.named_parameters()}
    fake.config = {"num_hidden_layers": student.config.num_hidden_layers}
    fake.weights_dir = str(tmp_path.resolve())
    conf = VLLMServerRolloutConfig(urls=[fake.url + "/"], model="student", greedy=True,
                                   weights_dir=str(tmp_path), weight_bucket_mb=3,
                                   verify_sync=False, startup_timeout=7.0, request_timeout=9.0,
                                   max_concurrent_requests=5)
    with build_engine(conf, student, tiny_tok, max_prompt_length=40, prompt_truncation="skip",
                      chat_template_kwargs={"x": 1}) as eng:
        assert isinstance(eng, VLLMServerEngine) and eng.holds_weights
        assert [c.url for c in eng.clients] == [fake.url]
        assert (eng.model, eng.greedy, eng.weights_dir, eng.weight_bucket_bytes,
                eng.verify_sync, eng.clients[0].timeout, eng.max_concurrent_requests) == (
            "student", True, tmp_path, 3 << 20, False, 9.0, 5)
        assert (eng.max_prompt_length, eng.prompt_truncation, eng.chat_template_kwargs) == (
            40, "skip", {"x": 1})
        assert eng.stop_token_ids == (STOP,)
        eng.load_weights(student.named_parameters())
        assert eng.last_sync_checked == 0  # verify_sync off


def test_saopd_serve_command() -> None:
    command, env, url = build_command(["--model", "/m", "--dtype", "float32"])
    assert url == "http://127.0.0.1:8000"
    assert command[0] == sys.executable and command[command.index("--host") + 1] == "127.0.0.1"
    assert "/m" in command and command[-4:] == ["--dtype", "float32", "--middleware", GUARD]
    assert command[command.index("--worker-extension-cls") + 1] == WORKER_EXTENSION
    assert command[command.index("--generation-config") + 1] == "vllm"
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env[INSTANCE_ENV]
    assert math.isclose(float(env[STARTED_ENV]), time.time(), abs_tol=60)
    command, _, url = build_command(["--model=/m", "--host", "0.0.0.0", "--port", "9001",
                                     "--generation-config", "auto"])
    assert url == f"http://{socket.getfqdn()}:9001" and command.count("--generation-config") == 1
    assert build_command(["--model", "/m"])[1][INSTANCE_ENV] != env[INSTANCE_ENV]
    for argv, match in [(["--model", "/m", "--worker-extension-cls", "x.Y"], "sets --worker"),
                        (["--model", "/m", "--logprobs-mode", "processed_logprobs"],
                         "must stay raw_logprobs"),
                        (["--model", "/m", "--port", "0"], r"--port must be in")]:
        with pytest.raises(ValueError, match=match):
            build_command(argv)


def test_saopd_serve_without_vllm_says_how_to_install(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr("saopd.vllm.server.cli.importlib.util.find_spec", lambda name: None)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        serve_main(["--model", str(tmp_path), "--port", str(free_port())])
    assert exit_info.value.code == 2
    assert "the vllm package is not installed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_main(["--model", "/m", "--worker-extension-cls", "x.Y"])
    assert "saopd-serve: error: saopd-serve sets" in capsys.readouterr().err
