"""Teacher scoring as a service: the teacher's log-probs of a step's contexts from a backend.

One small interface, :class:`TeacherScorer`: ``submit(batch, needs, messages=...)`` sends the
step's teacher contexts (``batch.teacher_view``: the student's contexts, or the teacher's own when
it has its own chat template) and returns at once a :class:`~saopd.scoring.passes.
PendingTeacherScores`; its ``result()`` gives :class:`~saopd.scoring.passes.TeacherScores`
``[B, R]`` (full, and residual when the step needs it) in the layout of the batch.
:func:`~saopd.scoring.passes.score_frozen` takes the pending scores and
:func:`~saopd.scoring.passes.score_student` waits for them only after the student's pass, so the
teacher scores while the student's residual and full passes run. Backends
(``teacher_scoring=<backend>``, :class:`~saopd.config.teacher_scoring.TeacherScoringConfig`;
built from a run's config by :func:`saopd.scoring.registry.build_scorer`):

- ``hf`` (:class:`HFTeacherScorer`): the teacher's module in this process, chunked scoring
  (:func:`~saopd.scoring.passes.score_teacher`); exact, synchronous. The trainer's default path
  (``OPDModule`` with a teacher module) runs the same passes directly, with the teacher's head
  for the exact KL and top-k lists.
- ``vllm`` (:class:`VLLMTeacherScorer`): a ``vllm.LLM`` of the teacher (its engine core in its
  own process by default, so the teacher computes while the trainer computes; on GPU on its own
  devices, ``teacher_scoring.devices``).
- ``vllm_server`` (:class:`VLLMServerTeacherScorer`): ``saopd-serve`` servers of the teacher over
  HTTP (``/v1/completions``); the trainer imports no ``vllm``. At start-up every server must
  prove it serves the teacher (:mod:`saopd.scoring.teacher_client`): the same architecture and
  sizes, the same tokenization of a probe text and the same weight files (their SHA-256
  digest, computed where the files are); a server of another model or checkpoint is refused,
  naming both.

The vLLM backends send the exact context ids saopd built (each row's real tokens, padding
removed; both paddings) as token-id prompts, the full contexts and, when the step needs them,
the residual ones, in one request batch per step (split over the servers), with
``max_tokens=1`` and ``prompt_logprobs=top_k`` (0: the log-prob of each prompt token only;
vLLM computes prompt log-probs from the raw logits, whatever its ``logprobs_mode``), with
detokenization off where the API allows it, and read the response tokens' log-probs back from
vLLM's ``prompt_logprobs`` (:mod:`saopd.scoring.prompt_logprobs`). The returned prompt ids are
checked against what was sent. Vision-language pairs: each context goes with one
``<|image_pad|>`` per image and the row's images as ``multi_modal_data`` (in-process vLLM only);
vLLM expands the images and its expanded ids must equal saopd's (``RuntimeError`` otherwise: the
processors disagree), as the rollout engine checks.

Only sampled-token log-probs come back. :func:`check_servable` refuses at start-up, naming the
option and what it needs, whatever asks for more: the exact KL over the vocabulary
(``objective=full_kl``, ``filter=tip``), the teacher's entropy (``filter=fire``,
``objective=entropy_aware``), the teacher's top-k lists (``objective=topk_kl``,
``entropy_aware``, ``filter=teachability``) and the teacher's log-probs at the student's top-k
ids (``filter=teachability``), unless ``teacher_scoring.top_k = K`` asks for the top-k
approximation: the teacher's top-K log-probs per position come back (``prompt_logprobs=K``) and
serve the teacher-top-k fields of any K' <= K (the teacher's own top K'; the student's log-probs
at those ids come from its pass, ``gather_ids``) and the teacher's entropy, over the top K and one
bucket holding the rest of the probability (a lower bound of the entropy). The exact KL and the
student's top-k lists are never served.

``vllm`` is imported on first use. This module cannot import :mod:`saopd.rollout` (the two are
one layer, independent): the process helpers it shares with
:class:`~saopd.rollout.vllm.VLLMEngine` (RNG and thread state around vLLM's start-up, the
launcher variables a clean engine-core start drops) are :mod:`saopd.serving.vllm_runtime`'s.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from saopd.contexts.batch import ContextBatch, PairedContextBatch
from saopd.scoring.passes import (
    PendingTeacherScores,
    ScoringNeeds,
    TeacherScores,
    score_teacher,
)
from saopd.scoring.prompt_logprobs import (
    assemble_scores,
    collapse_images,
    context_prompts,
    json_entry,
    response_token_index,
    scores_from_prompt_logprobs,
    top_k_for,
)
from saopd.scoring.teacher_client import TeacherReference, TeacherServerClient, teacher_reference
from saopd.serving.auth import client_api_key
from saopd.serving.http import ServerError
from saopd.serving.vllm_runtime import (
    LAUNCHER_VARIABLES,
    cpu_kv_cache_bytes,
    preserve_process_state,
    require_vllm,
    shutdown_llm,
    temporary_environ,
)
from saopd.signals.token_signals import STUDENT_TOPK_FIELDS, TEACHER_TOPK_FIELDS

if TYPE_CHECKING:
    from torch import nn

    from saopd.config.model import ModelConfig
    from saopd.config.teacher_scoring import TeacherScoringConfig

__all__ = [
    "DoneTeacherScores",
    "HFTeacherScorer",
    "TeacherScorer",
    "TeacherServiceError",
    "VLLMServerTeacherScorer",
    "VLLMTeacherScorer",
    "check_servable",
    "unservable",
]

log = logging.getLogger(__name__)


class TeacherServiceError(ServerError):
    """A teacher server (or engine) failed, cannot be reached, answered something unusable or
    does not serve the teacher; the message names it. An ``OSError``, so ``saopd-train`` reports
    it as a one-line error."""


@runtime_checkable
class TeacherScorer(Protocol):
    """A teacher-scoring backend (module docstring)."""

    name: str

    def submit(self, batch: PairedContextBatch, needs: ScoringNeeds, *,
               messages: Sequence[Sequence[Mapping[str, Any]]] | None = None
               ) -> PendingTeacherScores:
        """Start scoring ``batch.teacher_view`` (full, and residual if ``needs.residual``);
        ``messages``: the rows' chats (their images, for a vision-language pair)."""
        ...

    def close(self) -> None:
        """Free what the backend holds (engines, threads, folders)."""
        ...


class DoneTeacherScores:
    """Scores already computed (a synchronous backend)."""

    def __init__(self, scores: TeacherScores) -> None:
        self._scores = scores

    def result(self) -> TeacherScores:
        return self._scores


class _FutureScores:
    """Scores computed in a worker thread."""

    def __init__(self, future: Future[TeacherScores]) -> None:
        self._future = future

    def result(self) -> TeacherScores:
        return self._future.result()


# ---------------------------------------------------------------------------------------------
# what a service can serve

#: What each signal a service cannot give exactly needs, for the refusal messages.
_NEEDS_TEXT = {
    "kl": "the exact KL over the teacher's whole distribution (its full logits at every "
          "position)",
    "entropy_teacher": "the teacher's entropy over its whole distribution",
    "teacher_topk": "the teacher's top-{k} log-probs at every position",
    "student_topk": "the teacher's log-probs at the student's top-{k} tokens",
}


def unservable(components: Mapping[str, Any], top_k: int) -> list[str]:
    """What of ``components`` (``{"objective=full_kl": objective, "filter=tip": filter, ...}``,
    each with ``needs`` and ``top_k``) a vLLM teacher service with ``teacher_scoring.top_k =
    top_k`` cannot give: one message per component naming it and what it needs."""
    out = []
    for label, component in components.items():
        names = set(getattr(component, "needs", ()))
        k = int(getattr(component, "top_k", 0) or 0)
        missing = []
        if "kl" in names:
            missing.append(_NEEDS_TEXT["kl"])
        if "entropy_teacher" in names and top_k < 1:
            missing.append(_NEEDS_TEXT["entropy_teacher"] + " (teacher_scoring.top_k=K "
                           "approximates it over the top K + one tail bucket)")
        if set(TEACHER_TOPK_FIELDS) & names and top_k < k:
            missing.append(_NEEDS_TEXT["teacher_topk"].format(k=k)
                           + f" (teacher_scoring.top_k={k} or more gives them)")
        if set(STUDENT_TOPK_FIELDS) & names:
            missing.append(_NEEDS_TEXT["student_topk"].format(k=k))
        if missing:
            out.append(f"{label} needs " + " and ".join(missing))
    return out


def check_servable(components: Mapping[str, Any], backend: str, top_k: int) -> None:
    """``ValueError`` naming each option that needs more than ``teacher_scoring=<backend>``
    gives (:func:`unservable`); nothing for ``hf``."""
    if backend == "hf":
        return
    problems = unservable(components, top_k)
    if problems:
        raise ValueError(
            f"teacher_scoring={backend} returns the teacher's sampled-token log-probs"
            + (f" and its top-{top_k} log-probs" if top_k else "") + " only: "
            + "; ".join(problems) + ". Use teacher_scoring=hf for these (exact, teacher in the "
            "trainer)")


# ---------------------------------------------------------------------------------------------
# hf

class HFTeacherScorer:
    """``teacher_scoring=hf`` as a service: the teacher's module scores in this process,
    synchronously (:func:`~saopd.scoring.passes.score_teacher`)."""

    name = "hf"

    def __init__(self, teacher: nn.Module, *, vocab_size: int | None = None,
                 chunk_size: int | None = None) -> None:
        self.teacher = teacher
        self.vocab_size = vocab_size
        self.chunk_size = chunk_size

    def submit(self, batch: PairedContextBatch, needs: ScoringNeeds, *,
               messages: Sequence[Sequence[Mapping[str, Any]]] | None = None
               ) -> PendingTeacherScores:
        scores, _ = score_teacher(batch, self.teacher, needs=needs, vocab_size=self.vocab_size,
                                  chunk_size=self.chunk_size)
        return DoneTeacherScores(scores)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# vllm (an engine of the teacher started here)

class VLLMTeacherScorer:
    """``teacher_scoring=vllm``: a ``vllm.LLM`` of the teacher folder ``model_dir``.

    Args:
        model_dir: an HF model folder (or hub id) of the teacher, with its tokenizer.
        top_k: the top-k approximation's K (module docstring); 0 = sampled tokens only.
        dtype, max_model_len, gpu_memory_utilization, kv_cache_gb, enforce_eager,
        tensor_parallel_size: the engine's (``vllm.LLM``'s) options. On vLLM's CPU backend
            with no ``kv_cache_gb`` the KV cache is sized from the free memory and the model
            (:func:`~saopd.serving.vllm_runtime.cpu_kv_cache_bytes`), or the engine is refused
            before vLLM starts (``ValueError`` naming ``teacher_scoring.kv_cache_gb``).
        in_process: engine core in this process (else in its own: the default, so the
            teacher computes while the trainer does).
        devices: ``CUDA_VISIBLE_DEVICES`` of the engine core (its own GPUs); None = this
            process's. Needs ``in_process=False``.
        clean_environment: start the engine core without the launcher's rank variables (one
            engine per training rank).
        processor: the pair's Qwen-VL processor (vision-language teachers): contexts go with
            their images (module docstring).
        max_images_per_prompt: vLLM's per-prompt image limit (vision only).
        seed: vLLM's seed; startup_timeout: not enforced in-process (vLLM's own limits apply).
        owned_dir: remove ``model_dir`` on :meth:`close` (a folder saved for the engine).
        llm_kwargs: more ``vllm.LLM`` arguments.
    """

    name = "vllm"

    def __init__(self, model_dir: str | os.PathLike[str], *, top_k: int = 0,
                 dtype: str = "auto", max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.9, kv_cache_gb: float | None = None,
                 enforce_eager: bool = False, tensor_parallel_size: int = 1,
                 in_process: bool = False, devices: str | None = None,
                 clean_environment: bool = False, processor: Any | None = None,
                 max_images_per_prompt: int = 4, seed: int = 0, owned_dir: bool = False,
                 llm_kwargs: Mapping[str, Any] | None = None) -> None:
        if devices is not None and in_process:
            raise ValueError("VLLMTeacherScorer.devices needs in_process=False")
        self.model_dir = str(model_dir)
        self.top_k = int(top_k)
        self.processor = processor
        self._owned_dir = owned_dir
        self._image_id: int | None = None
        if processor is not None:
            self._image_id = int(processor.tokenizer.convert_tokens_to_ids(
                getattr(processor, "image_token", "<|image_pad|>")))
        require_vllm("teacher_scoring=vllm", "or serve the teacher with saopd-serve "
                     "(teacher_scoring=vllm_server)")
        from vllm import LLM

        kwargs: dict[str, Any] = {
            "model": self.model_dir, "tokenizer": self.model_dir, "dtype": dtype,
            "max_model_len": max_model_len, "gpu_memory_utilization": gpu_memory_utilization,
            "enforce_eager": enforce_eager, "tensor_parallel_size": tensor_parallel_size,
            "seed": seed, "generation_config": "vllm",
            # prompt_logprobs=K must be <= max_logprobs (vLLM's default 20)
            "max_logprobs": max(20, self.top_k),
        }
        extra = dict(llm_kwargs or {})
        if kv_cache_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * (1 << 30))
        elif "kv_cache_memory_bytes" not in extra:  # on CPU: sized here, not 90% of the RAM
            kv_bytes = cpu_kv_cache_bytes(self.model_dir, dtype=dtype,
                                          max_model_len=max_model_len,
                                          max_num_seqs=extra.get("max_num_seqs"),
                                          owner="teacher_scoring")
            if kv_bytes is not None:
                kwargs["kv_cache_memory_bytes"] = kv_bytes
        if processor is not None:
            kwargs["limit_mm_per_prompt"] = {"image": max_images_per_prompt, "video": 0}
        kwargs.update(extra)
        env: dict[str, str | None] = {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1"}
        if clean_environment:
            env.update(dict.fromkeys(LAUNCHER_VARIABLES))
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(devices)
        with preserve_process_state(), temporary_environ(env):
            self.llm = LLM(**kwargs)
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="saopd-teacher")
        self._lock = threading.Lock()
        self.last_score_seconds: float | None = None

    def _prompts(self, ctx: ContextBatch, which: str,
                 messages: Sequence[Sequence[Mapping[str, Any]]] | None) -> list[Any]:
        from vllm.inputs import TokensPrompt

        prompts = []
        for b, ids in enumerate(context_prompts(ctx)):
            if len(ids) + 1 > self.max_model_len:
                raise ValueError(
                    f"the teacher's {which} context of row {b} has {len(ids)} tokens; the "
                    f"teacher engine's max_model_len is {self.max_model_len} (one more slot is "
                    "needed): raise teacher_scoring.max_model_len")
            if self._image_id is not None and self._image_id in ids:
                from saopd.prompts.vision import load_image, message_images

                if messages is None:
                    raise ValueError("a vision-language teacher service needs the rows' "
                                     "messages (their images)")
                refs = message_images(messages[b])
                raw = collapse_images(ids, self._image_id)
                if raw.count(self._image_id) != len(refs):
                    raise ValueError(f"row {b}'s {which} context holds "
                                     f"{raw.count(self._image_id)} images, its chat "
                                     f"{len(refs)}")
                prompts.append(TokensPrompt(prompt_token_ids=raw, multi_modal_data={
                    "image": [load_image(r) for r in refs]}))
            else:
                prompts.append(TokensPrompt(prompt_token_ids=ids))
        return prompts

    def submit(self, batch: PairedContextBatch, needs: ScoringNeeds, *,
               messages: Sequence[Sequence[Mapping[str, Any]]] | None = None
               ) -> PendingTeacherScores:
        k = top_k_for(needs, self.top_k, "teacher_scoring=vllm")
        tb = batch.teacher_view
        contexts = [("full", tb.full)] + ([("residual", tb.residual)] if needs.residual else [])
        prompts, sent, index = [], [], []
        for which, ctx in contexts:
            prompts += self._prompts(ctx, which, messages)
            sent += context_prompts(ctx)
            index.append(response_token_index(ctx))
        targets, mask = tb.response_ids.cpu(), tb.response_mask.cpu()

        def run() -> TeacherScores:
            from vllm import SamplingParams

            started = time.perf_counter()
            params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k,
                                    detokenize=False)
            with self._lock:
                outputs = self.llm.generate(prompts, params, use_tqdm=False)
            rows = []
            for n, out in enumerate(outputs):
                got = list(out.prompt_token_ids or [])
                if got != sent[n]:
                    raise RuntimeError(
                        f"teacher vLLM engine: context {n} came back as {len(got)} prompt "
                        f"tokens, saopd built {len(sent[n])}"
                        + (": the two processors expand the images differently" if
                           self._image_id is not None else ""))
                plp = out.prompt_logprobs
                if plp is None or len(plp) != len(got):
                    raise RuntimeError("teacher vLLM engine returned no prompt log-probs "
                                       "(SamplingParams.prompt_logprobs was not honoured)")
                c, b = divmod(n, targets.shape[0])
                positions = index[c][b][mask[b]].tolist()
                rows.append([{int(t): float(v.logprob) for t, v in plp[j].items()}
                             for j in positions])
            b = targets.shape[0]
            parts = [scores_from_prompt_logprobs(rows[c * b:(c + 1) * b], targets, mask,
                                                 top_k=k, where="teacher vLLM engine",
                                                 error=TeacherServiceError)
                     for c in range(len(contexts))]
            self.last_score_seconds = time.perf_counter() - started
            return assemble_scores(parts, needs, k)

        return _FutureScores(self._pool.submit(run))

    def close(self) -> None:
        """Shut the engine down (and remove an owned model folder)."""
        pool = self.__dict__.pop("_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            shutdown_llm(llm)
            del llm
        if self._owned_dir:
            shutil.rmtree(self.model_dir, ignore_errors=True)
            self._owned_dir = False

    def __enter__(self) -> VLLMTeacherScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# vllm_server (saopd-serve servers of the teacher)

class VLLMServerTeacherScorer:
    """``teacher_scoring=vllm_server``: teacher servers (``saopd-serve --model <teacher>``).

    Start-up waits for every server's ``/health``, reads ``/v1/models`` (``model``, or the
    first server's model, which every server must serve; the smallest ``max_model_len``) and
    checks that each server serves the teacher
    (:class:`~saopd.scoring.teacher_client.TeacherServerClient`): it tokenizes a probe text as
    ``tokenizer`` (the teacher's) does (``/tokenize``) and, with ``teacher``
    (:class:`~saopd.scoring.teacher_client.TeacherReference`), its model's config and weight
    files' digest are the teacher's (``saopd_server_info``, ``saopd_server_weights_digest``).
    Each step's contexts are dealt out over the servers in contiguous shares, each share split
    into ``max_concurrent_requests`` requests (one ``/v1/completions`` of token-id prompts
    each, :meth:`~saopd.scoring.teacher_client.TeacherServerClient.prompt_logprobs`), sent in
    parallel threads. Every failure raises
    :class:`TeacherServiceError` naming the server. :meth:`from_config` is how ``saopd-train``
    builds it (with the reference).
    """

    name = "vllm_server"

    def __init__(self, urls: Sequence[str], *, tokenizer: Any | None = None,
                 teacher: TeacherReference | None = None, model: str | None = None,
                 top_k: int = 0, request_timeout: float = 1800.0,
                 startup_timeout: float = 600.0, max_concurrent_requests: int = 1,
                 api_key_file: str | None = None) -> None:
        if not urls:
            raise ValueError("teacher_scoring=vllm_server needs teacher_scoring.urls")
        self.servers = [TeacherServerClient(u, request_timeout, error=TeacherServiceError,
                                            api_key=client_api_key(
                                                api_key_file, u, "teacher_scoring.api_key_file"))
                        for u in urls]
        self.top_k = int(top_k)
        self.max_concurrent_requests = int(max_concurrent_requests)
        deadline = time.monotonic() + startup_timeout
        for server in self.servers:
            server.wait_healthy(deadline)
        lengths = []
        for server in self.servers:
            model, length = server.model_card(model)
            lengths.append(length)
        assert model is not None
        self.model = model
        self.max_model_len = min(lengths)
        for server in self.servers:
            if tokenizer is not None:
                server.check_tokenizer(self.model, tokenizer)
            if teacher is not None:
                server.check_serves(teacher)
        workers = len(self.servers) * self.max_concurrent_requests
        self._pool = ThreadPoolExecutor(max_workers=workers + 1,
                                        thread_name_prefix="saopd-teacher")
        self.last_score_seconds: float | None = None
        self.last_prompts_per_server: list[int] = [0] * len(self.servers)

    @classmethod
    def from_config(cls, conf: TeacherScoringConfig, teacher: ModelConfig,
                    tokenizer: Any) -> VLLMServerTeacherScorer:
        """The scorer of ``teacher_scoring=vllm_server``: ``conf``'s servers, checked against
        the teacher ``teacher`` configures (:func:`teacher_reference`) and its tokenizer."""
        return cls(conf.urls, tokenizer=tokenizer, teacher=teacher_reference(teacher),
                   model=conf.model, top_k=conf.top_k, request_timeout=conf.request_timeout,
                   startup_timeout=conf.startup_timeout,
                   max_concurrent_requests=conf.max_concurrent_requests,
                   api_key_file=conf.api_key_file)

    def submit(self, batch: PairedContextBatch, needs: ScoringNeeds, *,
               messages: Sequence[Sequence[Mapping[str, Any]]] | None = None
               ) -> PendingTeacherScores:
        k = top_k_for(needs, self.top_k, "teacher_scoring=vllm_server")
        tb = batch.teacher_view
        if getattr(tb.full, "pixel_values", None) is not None:
            raise ValueError("teacher_scoring=vllm_server scores text contexts only (use "
                             "teacher_scoring=vllm for a vision-language pair)")
        contexts = [tb.full] + ([tb.residual] if needs.residual else [])
        sent: list[list[int]] = []
        index = []
        for ctx in contexts:
            sent += context_prompts(ctx)
            index.append(response_token_index(ctx))
        longest = max(len(p) for p in sent)
        if longest + 1 > self.max_model_len:
            raise ValueError(f"a teacher context has {longest} tokens; the teacher servers' "
                             f"max_model_len is {self.max_model_len} (start them with a larger "
                             "--max-model-len)")
        targets, mask = tb.response_ids.cpu(), tb.response_mask.cpu()
        # contiguous shares per server, each split into max_concurrent_requests requests
        jobs: list[tuple[TeacherServerClient, int, int]] = []
        per = -(-len(sent) // len(self.servers))
        self.last_prompts_per_server = [0] * len(self.servers)
        for s, server in enumerate(self.servers):
            lo, hi = s * per, min(len(sent), (s + 1) * per)
            if lo >= hi:
                continue
            self.last_prompts_per_server[s] = hi - lo
            step = -(-(hi - lo) // self.max_concurrent_requests)
            jobs += [(server, a, min(hi, a + step)) for a in range(lo, hi, step)]
        futures = [self._pool.submit(server.prompt_logprobs, self.model, sent[a:b], k)
                   for server, a, b in jobs]

        def gather() -> TeacherScores:
            started = time.perf_counter()
            answers: list[tuple[list[int], list[Any]]] = []
            for future in futures:
                answers += future.result()
            rows = []
            for n, (_, plp) in enumerate(answers):
                c, b = divmod(n, targets.shape[0])
                positions = index[c][b][mask[b]].tolist()
                rows.append([json_entry(plp[j], TeacherServiceError) for j in positions])
            b = targets.shape[0]
            parts = [scores_from_prompt_logprobs(rows[c * b:(c + 1) * b], targets, mask,
                                                 top_k=k, where="teacher server",
                                                 error=TeacherServiceError)
                     for c in range(len(contexts))]
            self.last_score_seconds = time.perf_counter() - started
            return assemble_scores(parts, needs, k)

        return _FutureScores(self._pool.submit(gather))

    def close(self) -> None:
        pool = self.__dict__.pop("_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> VLLMServerTeacherScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
