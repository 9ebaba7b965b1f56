"""Teacher scoring as a service (saopd.scoring.teacher_service), without vLLM.

A loopback HTTP server that answers like vLLM's OpenAI server (``/health``, ``/v1/models``,
``/tokenize``, ``/v1/completions`` with ``prompt_logprobs``) from an HF teacher stands in for
``saopd-serve``: the service's log-probs equal the in-trainer teacher's for right and left
padding, full and residual, and for a teacher with its own chat template; the top-k
approximation serves the teacher-top-k fields (its own top K) and the tail-bucket entropy; what
needs more than sampled log-probs is refused naming the option; a server failure is an error
naming the server; ``saopd-train teacher_scoring=vllm_server`` trains with no teacher module and
takes the same steps as ``teacher_scoring=hf``. Real vLLM: tests/integration/vllm/
test_teacher_scoring.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from saopd.config.teacher_scoring import TeacherScoringConfig
from saopd.contexts.text import collate_contexts
from saopd.filters import FILTERS
from saopd.models.tiny import tiny_qwen3, tiny_tokenizer
from saopd.objectives import OBJECTIVES
from saopd.scoring.hf_teacher import HFTeacherScorer
from saopd.scoring.passes import (
    ScoringNeeds,
    TeacherScores,
    score_frozen,
    score_student,
    score_teacher,
)
from saopd.scoring.teacher_service import check_servable, unservable
from saopd.vllm.client.teacher import VLLMServerTeacherScorer
from saopd.vllm.client.teacher_server import TeacherServiceError
from saopd.vllm.prompt_logprobs import context_prompts, response_token_index, topk_entropy
from saopd.vllm.weights_files import weights_digest

CONF = Path(__file__).resolve().parents[2] / "conf"
PROMPTS = ["Alice has 3 apples and buys 2 more books.", "Bob sells 7 marbles to Maria.", "hi"]


# ---- a loopback stand-in for a vLLM server of the teacher ---------------------------------
class FakeTeacherServer:
    """Answers like vLLM's OpenAI server, from an HF model (prompt log-probs of the raw logits:
    the prompt token and the top ``prompt_logprobs`` per position; JSON keys are strings)."""

    def __init__(self, model: Any, tokenizer: Any, *, name: str = "teacher",
                 max_model_len: int = 512, folder: Path | None = None) -> None:
        self.model, self.tokenizer, self.name = model, tokenizer, name
        # the folder the model was saved to: what saopd-serve's worker answers for the trainer's
        # identity check (saopd_server_info: its config; saopd_server_weights_digest)
        self.folder = folder
        self.max_model_len = max_model_len
        self.requests: list[dict[str, Any]] = []
        self.fail_with: int | None = None  # answer every completion with this HTTP status
        lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: Any) -> None:
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._send(200, {})
                elif self.path == "/v1/models":
                    self._send(200, {"data": [{"id": fake.name,
                                               "max_model_len": fake.max_model_len}]})
                else:
                    self._send(404, {"error": "no such path"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    ids = fake.tokenizer(body["prompt"], add_special_tokens=False)["input_ids"]
                    self._send(200, {"tokens": list(ids)})
                    return
                if self.path == "/collective_rpc" and fake.folder is not None:
                    self._send(200, {"results": [fake.rpc(body["method"])]})
                    return
                if fake.fail_with is not None:
                    self._send(fake.fail_with, {"error": {"message": "engine dead"}})
                    return
                fake.requests.append(body)
                with lock:
                    choices = [fake.choice(i, p, int(body["prompt_logprobs"]))
                               for i, p in enumerate(body["prompt"])]
                self._send(200, {"choices": choices})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def rpc(self, method: str) -> dict[str, Any]:
        """saopd-serve's identity answers for the model saved in :attr:`folder`."""
        assert self.folder is not None
        if method == "saopd_server_info":
            config = json.loads((self.folder / "config.json").read_text())
            return {"model": str(self.folder), "config": config}
        if method == "saopd_server_weights_digest":
            digest = weights_digest(str(self.folder))
            return {"digest": digest.digest, "source": digest.source}
        return {"error": f"no method {method}"}

    @torch.no_grad()
    def choice(self, index: int, ids: list[int], k: int) -> dict[str, Any]:
        logits = self.model(torch.tensor([ids])).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        entries: list[Any] = [None]
        for j in range(1, len(ids)):
            row = lp[j - 1]
            entry = {str(ids[j]): {"logprob": float(row[ids[j]]), "rank": 1}}
            if k:
                top = torch.topk(row, k)
                for v, t in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                    entry[str(t)] = {"logprob": v, "rank": 1}
            entries.append(entry)
        return {"index": index, "text": "", "prompt_logprobs": entries,
                "prompt_token_ids": ids, "token_ids": [0]}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def setup():
    tok = tiny_tokenizer()
    teacher = tiny_qwen3(tok, layers=2, hidden=64, seed=5).eval()
    student = tiny_qwen3(tok, layers=1, hidden=64, seed=6).eval()
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(4, len(tok), (n,), generator=g).tolist() for n in (9, 4, 13)]
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    return tok, teacher, student, messages, responses


@pytest.fixture(scope="module")
def server(setup) -> Iterator[FakeTeacherServer]:
    tok, teacher, *_ = setup
    fake = FakeTeacherServer(teacher, tok)
    yield fake
    fake.close()


# ---- contexts -> prompts --------------------------------------------------------------------
@pytest.mark.parametrize("side", ["right", "left"])
def test_prompts_are_the_real_ids_and_the_index_finds_the_response(setup, side) -> None:
    tok, _, _, messages, responses = setup
    batch = collate_contexts(tok, messages, responses, padding_side=side)
    for ctx in (batch.full, batch.residual):
        prompts = context_prompts(ctx)
        index = response_token_index(ctx)
        for b, r in enumerate(responses):
            assert len(prompts[b]) == int(ctx.lengths[b])
            assert [prompts[b][j] for j in index[b, :len(r)].tolist()] == r


# ---- the server backend equals the in-trainer teacher ---------------------------------------
@pytest.mark.parametrize("side", ["right", "left"])
def test_server_scores_equal_the_hf_teacher(setup, server, side) -> None:
    tok, teacher, _, messages, responses = setup
    batch = collate_contexts(tok, messages, responses, padding_side=side)
    needs = ScoringNeeds(residual=True)
    ref, _ = score_teacher(batch, teacher, needs=needs)
    with VLLMServerTeacherScorer([server.url], tokenizer=tok,
                                 max_concurrent_requests=2) as scorer:
        got = scorer.submit(batch, needs).result()
        assert scorer.last_prompts_per_server == [2 * len(responses)]
    mask = batch.response_mask
    for name in ("lp_teacher", "lp_teacher_res"):
        torch.testing.assert_close(getattr(got, name)[mask], getattr(ref, name)[mask],
                                   atol=1e-5, rtol=0)
    body = server.requests[-1]
    assert body["max_tokens"] == 1 and body["prompt_logprobs"] == 0


def test_the_work_is_split_over_servers(setup, server) -> None:
    tok, teacher, _, messages, responses = setup
    second = FakeTeacherServer(teacher, tok)
    try:
        batch = collate_contexts(tok, messages, responses)
        needs = ScoringNeeds(residual=True)
        with VLLMServerTeacherScorer([server.url, second.url], tokenizer=tok) as scorer:
            got = scorer.submit(batch, needs).result()
            assert scorer.last_prompts_per_server == [3, 3]
        ref, _ = score_teacher(batch, teacher, needs=needs)
        mask = batch.response_mask
        torch.testing.assert_close(got.lp_teacher_res[mask], ref.lp_teacher_res[mask],
                                   atol=1e-5, rtol=0)
    finally:
        second.close()


def test_a_teacher_with_its_own_template_scores_its_own_contexts(setup, server) -> None:
    """``batch.teacher_view``: the service scores the teacher's contexts when it has them."""
    import dataclasses

    tok, teacher, _, messages, responses = setup
    batch = collate_contexts(tok, messages, responses)
    own = collate_contexts(tok, [[{"role": "system", "content": "Be exact."}, *m]
                                 for m in messages], responses)
    paired = dataclasses.replace(batch, teacher=own)
    needs = ScoringNeeds(residual=True)
    with VLLMServerTeacherScorer([server.url], tokenizer=tok) as scorer:
        got = scorer.submit(paired, needs).result()
    ref, _ = score_teacher(paired, teacher, needs=needs)
    plain, _ = score_teacher(batch, teacher, needs=needs)
    mask = batch.response_mask
    torch.testing.assert_close(got.lp_teacher[mask], ref.lp_teacher[mask], atol=1e-5, rtol=0)
    assert (got.lp_teacher[mask] - plain.lp_teacher[mask]).abs().max() > 1e-4


def test_pending_scores_give_the_same_signals_as_the_teacher_module(setup, server) -> None:
    tok, teacher, student, messages, responses = setup
    batch = collate_contexts(tok, messages, responses)
    needs = ScoringNeeds(residual=True)
    with torch.no_grad():
        ref = score_student(batch, score_frozen(batch, student=student, teacher=teacher,
                                                reference=None, needs=needs),
                            student=student, needs=needs)
        with VLLMServerTeacherScorer([server.url], tokenizer=tok) as scorer:
            frozen = score_frozen(batch, student=student, teacher=None, reference=None,
                                  needs=needs, teacher_scores=scorer.submit(batch, needs))
            assert frozen.pending is not None and frozen.lp_teacher is None
            got = score_student(batch, frozen, student=student, needs=needs)
    assert frozen.pending is None and frozen.teacher_wait >= 0.0
    mask = batch.response_mask
    for name in ("lp_teacher", "lp_teacher_res", "lp_student", "lp_student_res"):
        torch.testing.assert_close(getattr(got, name)[mask], getattr(ref, name)[mask],
                                   atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="needs the teacher module or teacher_scores"):
        score_frozen(batch, student=student, teacher=None, reference=None, needs=needs)


def test_hf_scorer_is_the_in_trainer_teacher(setup) -> None:
    tok, teacher, _, messages, responses = setup
    batch = collate_contexts(tok, messages, responses)
    needs = ScoringNeeds(residual=True, teacher_entropy=True)
    got = HFTeacherScorer(teacher).submit(batch, needs).result()
    ref, _ = score_teacher(batch, teacher, needs=needs)
    assert isinstance(got, TeacherScores)
    for name in ("lp_teacher", "lp_teacher_res", "entropy_teacher"):
        assert torch.equal(getattr(got, name), getattr(ref, name))


# ---- top-k approximation --------------------------------------------------------------------
def test_top_k_serves_the_teacher_top_k_fields_and_a_tail_bucket_entropy(setup, server) -> None:
    tok, teacher, student, messages, responses = setup
    batch = collate_contexts(tok, messages, responses)
    objective = OBJECTIVES.build("topk_kl", top_k=4)
    needs = ScoringNeeds.of(FILTERS.build("none"), objective, extra=("entropy_teacher",))
    assert needs.teacher_top_k == 4
    with torch.no_grad():
        ref = score_student(batch, score_frozen(batch, student=student, teacher=teacher,
                                                reference=None, needs=needs),
                            student=student, needs=needs)
        with VLLMServerTeacherScorer([server.url], tokenizer=tok, top_k=6) as scorer:
            frozen = score_frozen(batch, student=student, teacher=None, reference=None,
                                  needs=needs, teacher_scores=scorer.submit(batch, needs))
            got = score_student(batch, frozen, student=student, needs=needs)
        with VLLMServerTeacherScorer([server.url], tokenizer=tok, top_k=2) as small, \
                pytest.raises(ValueError, match=r"top-4 log-probs .* teacher_scoring.top_k is 2"):
            small.submit(batch, needs)
    mask = batch.response_mask
    assert torch.equal(got.teacher_topk_ids[mask], ref.teacher_topk_ids[mask])
    for name in ("teacher_topk_lp_teacher", "teacher_topk_lp_student", "lp_teacher"):
        torch.testing.assert_close(getattr(got, name)[mask], getattr(ref, name)[mask],
                                   atol=1e-5, rtol=0)
    # the tail-bucket entropy is a lower bound of the exact one
    assert bool((got.entropy_teacher[mask] <= ref.entropy_teacher[mask] + 1e-5).all())
    full = torch.log_softmax(torch.randn(3, 50), -1)
    exact = -(full.exp() * full).sum(-1)
    top = full.sort(-1, descending=True).values
    assert torch.allclose(topk_entropy(top), exact, atol=1e-5)  # K = V: exact
    assert bool((topk_entropy(top[:, :5]) <= exact).all())


# ---- refusals -------------------------------------------------------------------------------
@pytest.mark.parametrize(("group", "name", "kwargs", "match"), [
    ("objective", "full_kl", {}, r"objective=full_kl needs the exact KL"),
    ("filter", "tip", {}, r"filter=tip needs the exact KL"),
    ("filter", "fire", {}, r"filter=fire needs the teacher's entropy .*teacher_scoring.top_k"),
    ("objective", "topk_kl", {}, r"objective=topk_kl needs the teacher's top-32 log-probs "
                                 r"at every position \(teacher_scoring.top_k=32 or more"),
    ("objective", "entropy_aware", {}, r"objective=entropy_aware needs the teacher's entropy"),
    ("filter", "teachability", {}, r"filter=teachability needs .* the teacher's log-probs at "
                                   r"the student's top-16 tokens"),
])
def test_what_needs_more_than_sampled_log_probs_is_refused(group, name, kwargs, match) -> None:
    build = FILTERS.build if group == "filter" else OBJECTIVES.build
    component = build(name, **kwargs)
    with pytest.raises(ValueError, match=match):
        check_servable({f"{group}={name}": component}, "vllm", 0)
    check_servable({f"{group}={name}": component}, "hf", 0)  # hf serves everything


def test_top_k_lifts_only_what_it_approximates() -> None:
    comps = {"objective=topk_kl": OBJECTIVES.build("topk_kl"),
             "objective=entropy_aware": OBJECTIVES.build("entropy_aware"),
             "filter=fire": FILTERS.build("fire"),
             "objective=full_kl": OBJECTIVES.build("full_kl"),
             "filter=teachability": FILTERS.build("teachability")}
    left = unservable(comps, 32)
    assert [m.split(" ")[0] for m in left] == ["objective=full_kl", "filter=teachability"]
    assert len(unservable(comps, 16)) == 3  # topk_kl's K = 32 > 16
    for ok in ("sa_opd", "none", "random", "divergence_only", "proxy_replacement"):
        check_servable({f"filter={ok}": FILTERS.build(ok),
                        "objective=exopd": OBJECTIVES.build("exopd")}, "vllm_server", 0)


# ---- failures ---------------------------------------------------------------------------------
def test_a_failing_or_missing_server_is_named(setup) -> None:
    tok, teacher, _, messages, responses = setup
    batch = collate_contexts(tok, messages, responses)
    fake = FakeTeacherServer(teacher, tok)
    scorer = VLLMServerTeacherScorer([fake.url], tokenizer=tok, request_timeout=10)
    fake.fail_with = 500
    with pytest.raises(TeacherServiceError, match=rf"teacher server {fake.url}: POST "
                                                  r"/v1/completions answered HTTP 500.*engine"):
        scorer.submit(batch, ScoringNeeds()).result()
    fake.close()
    with pytest.raises(TeacherServiceError, match=rf"teacher server {fake.url}.* failed .*is "
                                                  r"the teacher server running"):
        scorer.submit(batch, ScoringNeeds()).result()
    scorer.close()
    with pytest.raises(TeacherServiceError, match=r"was not healthy within"):
        VLLMServerTeacherScorer([fake.url], startup_timeout=0.5)


def test_a_server_of_another_model_is_refused(setup) -> None:
    tok, teacher, *_ = setup
    fake = FakeTeacherServer(teacher, tok, name="other")
    try:
        with pytest.raises(TeacherServiceError, match=r"serves \['other'\], not 'teacher'"):
            VLLMServerTeacherScorer([fake.url], model="teacher")

        class Shifted:  # a tokenizer that disagrees with the server's
            def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
                return {"input_ids": [i + 1 for i in tok(text, add_special_tokens=False)[
                    "input_ids"]]}

        with pytest.raises(TeacherServiceError, match=r"does not serve the teacher"):
            VLLMServerTeacherScorer([fake.url], tokenizer=Shifted())
    finally:
        fake.close()


# ---- config -----------------------------------------------------------------------------------
def test_config_refuses_other_backends_options_and_missing_urls() -> None:
    with pytest.raises(ValueError, match=r"needs the teacher servers' URLs"):
        TeacherScoringConfig(backend="vllm_server")
    with pytest.raises(ValueError, match=r"teacher_scoring=vllm does not use "
                                         r"teacher_scoring.urls \(an option of vllm_server\)"):
        TeacherScoringConfig(backend="vllm", urls=["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match=r"teacher_scoring=hf does not use "
                                         r"teacher_scoring.kv_cache_gb \(an option of vllm\)"):
        TeacherScoringConfig(kv_cache_gb=1.0)
    with pytest.raises(ValueError, match=r"top_k is the top-k approximation"):
        TeacherScoringConfig(top_k=8)
    with pytest.raises(ValueError, match=r"backend must be one of"):
        TeacherScoringConfig(backend="tgi")
    with pytest.raises(ValueError, match=r"needs its engine core in its own process"):
        TeacherScoringConfig(backend="vllm", devices="1", in_process=True)
    assert TeacherScoringConfig(backend="vllm", top_k=20, devices="2,3").top_k == 20


@pytest.mark.parametrize("path", sorted((CONF / "teacher_scoring").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_yaml_files_hold_known_keys_and_no_restated_default(path: Path) -> None:
    import dataclasses

    node = yaml.safe_load(path.read_text()) or {}
    fields = {f.name: f for f in dataclasses.fields(TeacherScoringConfig)}
    assert set(node) <= set(fields), f"{path.name}: unknown keys {set(node) - set(fields)}"
    assert [k for k, v in node.items() if fields[k].default == v] == []
    assert node.get("backend", "hf") == path.stem


# ---- whole runs -----------------------------------------------------------------------------
class _Record:
    """Keeps each step's filtered mask and loss (what the filter chose, and the step)."""

    def __init__(self) -> None:
        import lightning as L

        record = self

        class CB(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, *args: Any) -> None:
                record.steps.append((outputs["view"].filtered.clone(),
                                     float(trainer.callback_metrics["train/loss"])))
                record.teacher = pl_module.teacher

        self.steps: list[tuple[torch.Tensor, float]] = []
        self.teacher: Any = "unset"
        self.callback = CB()


def test_training_against_a_server_takes_the_hf_steps(make_cfg, tmp_path) -> None:
    """3 SA-OPD steps of experiment=tiny with teacher_scoring=vllm_server (a loopback server of
    the same teacher): no teacher module in the trainer, the same filtered tokens and losses."""
    from saopd.models.tiny import tiny_qwen3 as build
    from saopd.train import train

    tok = tiny_tokenizer()
    folder = tmp_path / "teacher"
    model = build(tok, layers=4, seed=2)  # experiment=tiny's teacher
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    common = ["experiment=tiny", "steps=3", "trainer.view_every_n_steps=0",
              "trainer.checkpoint_every_n_steps=3", "teacher.tiny=null",
              f"teacher.name_or_path={folder}"]
    hf = _Record()
    train(make_cfg(*common, mlflow=False, tmp=tmp_path / "hf"), extra_callbacks=[hf.callback])
    fake = FakeTeacherServer(model.eval(), tok, folder=folder)
    try:
        served = _Record()
        train(make_cfg(*common, "teacher_scoring=vllm_server",
                       f"teacher_scoring.urls=[{fake.url}]", mlflow=False, tmp=tmp_path / "srv"),
              extra_callbacks=[served.callback])
    finally:
        fake.close()
    assert served.teacher is None and hf.teacher is not None
    assert len(served.steps) == len(hf.steps) == 3
    for (f_a, loss_a), (f_b, loss_b) in zip(hf.steps, served.steps, strict=True):
        assert torch.equal(f_a, f_b)
        assert loss_a == pytest.approx(loss_b, abs=1e-5)


def test_training_refuses_a_server_of_another_checkpoint(make_cfg, tmp_path) -> None:
    """issue 27: saopd-train checks the served weights against the teacher's files before the
    first step: a server of another checkpoint of the same shape (and tokenizer) is refused,
    naming both; the same server of the teacher's own folder is accepted (the test above)."""
    from saopd.train import UserError, train

    tok = tiny_tokenizer()
    folders = {}
    for name, seed in (("teacher", 2), ("other", 3)):
        folders[name] = tmp_path / name
        tiny_qwen3(tok, layers=4, seed=seed).save_pretrained(folders[name])
        tok.save_pretrained(folders[name])
    fake = FakeTeacherServer(tiny_qwen3(tok, layers=4, seed=3).eval(), tok,
                             folder=folders["other"])
    try:
        with pytest.raises(UserError, match=rf"^teacher_scoring: teacher server {fake.url} serves "
                                            r"the weights of .*other.*not those of the teacher"):
            train(make_cfg("experiment=tiny", "steps=1", "teacher.tiny=null",
                           f"teacher.name_or_path={folders['teacher']}",
                           "teacher_scoring=vllm_server", f"teacher_scoring.urls=[{fake.url}]",
                           mlflow=False, tmp=tmp_path / "run"))
        assert fake.requests == []  # refused before any scoring request
    finally:
        fake.close()


@pytest.mark.parametrize(("override", "match"), [
    ("objective=full_kl", r"teacher_scoring: teacher_scoring=vllm_server returns the teacher's "
                          r"sampled-token log-probs only: objective=full_kl needs the exact KL"),
    ("filter=fire", r"filter=fire needs the teacher's entropy"),
])
def test_saopd_train_refuses_before_loading_models(make_cfg, monkeypatch, override,
                                                   match) -> None:
    import saopd.train as train_mod

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("models were built")

    monkeypatch.setattr(train_mod, "build_models", never)
    cfg = make_cfg("experiment=tiny", override, "teacher_scoring=vllm_server",
                   "teacher_scoring.urls=[http://127.0.0.1:9]", mlflow=False)
    with pytest.raises(train_mod.UserError, match=match):
        train_mod.train(cfg)


def test_a_server_that_dies_mid_run_stops_training_naming_it(make_cfg, tmp_path) -> None:
    from saopd.train import UserError, train

    tok = tiny_tokenizer()
    folder = tmp_path / "teacher"
    model = tiny_qwen3(tok, layers=4, seed=2)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    fake = FakeTeacherServer(model.eval(), tok, folder=folder)
    import lightning as L

    class Kill(L.Callback):
        def on_train_batch_end(self, trainer, *args: Any) -> None:
            fake.fail_with = 503

    try:
        with pytest.raises(UserError, match=rf"teacher_scoring: teacher server {fake.url}: "
                                            r"POST /v1/completions answered HTTP 503"):
            train(make_cfg("experiment=tiny", "steps=3", "teacher.tiny=null",
                           f"teacher.name_or_path={folder}", "teacher_scoring=vllm_server",
                           f"teacher_scoring.urls=[{fake.url}]", "trainer.view_every_n_steps=0",
                           mlflow=False), extra_callbacks=[Kill()])
    finally:
        fake.close()
