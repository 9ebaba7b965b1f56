"""Teacher scoring as a service: the teacher's log-probs of a step's contexts from a backend.

One small interface, :class:`TeacherScorer`: ``submit(batch, needs, messages=...)`` sends the
step's teacher contexts (``batch.teacher_view``: the student's contexts, or the teacher's own when
it has its own chat template) and returns at once a :class:`~saopd.scoring.passes.
PendingTeacherScores`; its ``result()`` gives :class:`~saopd.scoring.passes.TeacherScores`
``[B, R]`` (full, and residual when the step needs it) in the layout of the batch.
:func:`~saopd.scoring.passes.score_frozen` takes the pending scores and
:func:`~saopd.scoring.passes.score_student` waits for them only after the student's pass, so the
teacher scores while the student's residual and full passes run. Backends
(``teacher_scoring=<backend>``, :class:`~saopd.config.teacher_scoring.TeacherScoringConfig`):

- ``hf`` (:class:`HFTeacherScorer`): the teacher's module in this process, chunked scoring
  (:func:`~saopd.scoring.passes.score_teacher`); exact, synchronous. The trainer's default path
  (``OPDModule`` with a teacher module) runs the same passes directly, with the teacher's head
  for the exact KL and top-k lists.
- ``vllm`` (:class:`VLLMTeacherScorer`): a ``vllm.LLM`` of the teacher (its engine core in its
  own process by default, so the teacher computes while the trainer computes; on GPU on its own
  devices, ``teacher_scoring.devices``).
- ``vllm_server`` (:class:`VLLMServerTeacherScorer`): ``saopd-serve`` servers of the teacher over
  HTTP (``/v1/completions``); the trainer imports no ``vllm``. At start-up every server must
  prove it serves the teacher (:class:`TeacherReference`, built from the teacher's config by
  :func:`teacher_reference`): the same architecture and sizes, the same tokenization of a probe
  text and the same weight files (their SHA-256 digest, computed where the files are:
  :mod:`saopd.serving.weights_files`); a server of another model or checkpoint is refused,
  naming both.

The vLLM backends send the exact context ids saopd built (each row's real tokens, padding
removed; both paddings) as token-id prompts, the full contexts and, when the step needs them,
the residual ones, in one request batch per step (split over the servers), with
``max_tokens=1`` and ``prompt_logprobs=top_k`` (0: the log-prob of each prompt token only;
vLLM computes prompt log-probs from the raw logits, whatever its ``logprobs_mode``), with
detokenization off where the API allows it. vLLM's ``prompt_logprobs[j]`` is the log-prob of
prompt token ``j`` given the tokens before it (``None`` at ``j = 0``); the response token of slot
``r`` sits at padded position ``gather_index[r] + 1``, i.e. at the real-token index
``cumsum(attention_mask) - 1`` there (:func:`response_token_index`). The returned prompt ids are
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
one layer, independent): the few process helpers it shares with
:class:`~saopd.rollout.vllm.VLLMEngine` (RNG and thread state around vLLM's start-up, the
launcher variables a clean engine-core start drops) are repeated here.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from saopd.contexts.batch import ContextBatch, PairedContextBatch
from saopd.scoring.passes import (
    PendingTeacherScores,
    ScoringNeeds,
    TeacherScores,
    score_teacher,
)
from saopd.serving.auth import client_api_key
from saopd.serving.http import JsonClient, ServerError
from saopd.serving.identity import config_differences, config_values
from saopd.serving.vllm_runtime import (
    LAUNCHER_VARIABLES,
    cpu_kv_cache_bytes,
    preserve_process_state,
    require_vllm,
    shutdown_llm,
    temporary_environ,
)
from saopd.serving.weights_files import WeightsDigest, weights_digest
from saopd.signals.token_signals import STUDENT_TOPK_FIELDS, TEACHER_TOPK_FIELDS

if TYPE_CHECKING:
    from torch import nn

    from saopd.config.model import ModelConfig
    from saopd.config.teacher_scoring import TeacherScoringConfig

__all__ = [
    "DoneTeacherScores",
    "HFTeacherScorer",
    "TeacherReference",
    "TeacherScorer",
    "TeacherServiceError",
    "VLLMServerTeacherScorer",
    "VLLMTeacherScorer",
    "check_servable",
    "context_prompts",
    "response_token_index",
    "scores_from_prompt_logprobs",
    "teacher_reference",
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
# contexts -> prompts, prompt log-probs -> [B, R]

def context_prompts(ctx: ContextBatch) -> list[list[int]]:
    """Each row's real context ids (padding removed, either side)."""
    mask = ctx.attention_mask.bool().cpu()
    ids = ctx.input_ids.cpu()
    return [ids[b][mask[b]].tolist() for b in range(ids.shape[0])]


def response_token_index(ctx: ContextBatch) -> torch.Tensor:
    """``[B, R]`` index, among each row's real tokens, of the token of response slot ``r``
    (the token at padded position ``gather_index + 1``); 0 in padded slots is not meaningful."""
    mask = ctx.attention_mask.cpu()
    real = mask.cumsum(-1) - 1  # [B, T] index among the real tokens
    pos = (ctx.gather_index.cpu() + 1).clamp(max=mask.shape[1] - 1)
    return real.gather(1, pos)


def _topk_of(entry: Mapping[int, float], k: int) -> tuple[list[int], list[float]]:
    """The ``k`` largest entries (ties: the smaller id first), padded if fewer came back."""
    best = sorted(entry.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
    ids = [i for i, _ in best] + [0] * (k - len(best))
    lps = [v for _, v in best] + [-math.inf] * (k - len(best))
    return ids, lps


def scores_from_prompt_logprobs(
        rows: Sequence[Sequence[Mapping[int, float]]], targets: torch.Tensor,
        mask: torch.Tensor, *, top_k: int = 0, where: str = "the teacher service"
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(lp [B, R], topk_ids [B, R, K] | None, topk_lp [B, R, K] | None)`` from each row's
    prompt log-probs at its response positions (``rows[b][r]``: ``{token id: log-prob}`` of
    response slot ``r``, for the valid slots of ``mask``). The target token must be among them
    (``TeacherServiceError`` otherwise); padded slots hold 0 (ids 0, log-probs -inf)."""
    b, r = targets.shape
    lp = torch.zeros((b, r), dtype=torch.float32)
    ids = torch.zeros((b, r, top_k), dtype=torch.long) if top_k else None
    tlp = torch.full((b, r, top_k), -math.inf, dtype=torch.float32) if top_k else None
    tgt = targets.cpu().tolist()
    valid = mask.cpu().tolist()
    for i in range(b):
        n = sum(valid[i])
        if len(rows[i]) != n:
            raise TeacherServiceError(f"{where}: row {i} came back with {len(rows[i])} "
                                      f"response log-probs, expected {n}")
        for j, entry in enumerate(rows[i]):
            token = tgt[i][j]
            if token not in entry:
                raise TeacherServiceError(
                    f"{where}: row {i}, response token {j} (id {token}) has no prompt log-prob "
                    f"(got ids {sorted(entry)[:8]}): the service scored other ids than it was "
                    "sent")
            lp[i, j] = float(entry[token])
            if top_k:
                assert ids is not None and tlp is not None
                top_ids, top_lps = _topk_of(entry, top_k)
                ids[i, j] = torch.tensor(top_ids)
                tlp[i, j] = torch.tensor(top_lps)
    return lp, ids, tlp


def topk_entropy(topk_lp: torch.Tensor) -> torch.Tensor:
    """The entropy ``[B, R]`` of the distribution made of the top-K probabilities and one
    bucket with the rest (``1 - sum``): a lower bound of the full distribution's entropy."""
    p = topk_lp.float().exp()
    inner = -(p * topk_lp.float().clamp(min=-1e4)).nan_to_num(0.0).sum(-1)
    tail = (1.0 - p.sum(-1)).clamp(min=0.0)
    return inner - torch.where(tail > 0, tail * tail.clamp(min=1e-30).log(),
                               torch.zeros_like(tail))


def _assemble(parts: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]],
              needs: ScoringNeeds, top_k: int) -> TeacherScores:
    """TeacherScores from the full (and residual) parts."""
    (lp, ids, tlp), res = parts[0], (parts[1] if len(parts) > 1 else None)
    entropy = topk_entropy(tlp) if needs.teacher_entropy and tlp is not None else None
    return TeacherScores(lp_teacher=lp, lp_teacher_res=None if res is None else res[0],
                         entropy_teacher=entropy,
                         topk_ids=ids if needs.teacher_top_k else None,
                         topk_logprobs=tlp if needs.teacher_top_k else None)


def _top_k_for(needs: ScoringNeeds, top_k: int, where: str) -> int:
    """The K a request must ask for (0 = sampled tokens only); ``ValueError`` when the step
    needs more than the service was configured to give."""
    want = max(needs.teacher_top_k, 1 if needs.teacher_entropy else 0)
    if needs.kl or needs.student_top_k:
        raise ValueError(f"{where}: the step needs the teacher's whole distribution (exact KL "
                         "or the student's top-k lists); a teacher service cannot give it")
    if want > top_k:
        raise ValueError(f"{where}: the step needs the teacher's top-{want} log-probs (or its "
                         f"entropy) but teacher_scoring.top_k is {top_k}")
    return top_k if want else 0


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
# process helpers around vLLM (as saopd.rollout.vllm's)

def _collapse_images(ids: Sequence[int], image_id: int) -> list[int]:
    """``ids`` with every run of ``image_id`` collapsed to one (the unexpanded prompt)."""
    out: list[int] = []
    for t in ids:
        if t == image_id and out and out[-1] == image_id:
            continue
        out.append(int(t))
    return out


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
                raw = _collapse_images(ids, self._image_id)
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
        k = _top_k_for(needs, self.top_k, "teacher_scoring=vllm")
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
                                                 top_k=k, where="teacher vLLM engine")
                     for c in range(len(contexts))]
            self.last_score_seconds = time.perf_counter() - started
            return _assemble(parts, needs, k)

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

def _server(url: str, timeout: float, api_key: str | None) -> JsonClient:
    """JSON over HTTP with one teacher server; every error names its URL."""
    return JsonClient(url, timeout, role="teacher server", error=TeacherServiceError,
                      request_option="teacher_scoring.request_timeout",
                      startup_option="teacher_scoring.startup_timeout", api_key=api_key,
                      key_option="teacher_scoring.api_key_file")


@dataclass(frozen=True)
class TeacherReference:
    """What a teacher server must serve (:func:`teacher_reference`).

    Attributes:
        name: the teacher as configured (``teacher.name_or_path``), for messages.
        config: its :func:`~saopd.serving.identity.config_values`.
        weights: the fingerprint of its weight files.
    """

    name: str
    config: dict[str, Any]
    weights: WeightsDigest


def teacher_reference(teacher: ModelConfig) -> TeacherReference:
    """The :class:`TeacherReference` of the teacher ``teacher`` configures: its config and the
    digest of its weight files, read where they are (a folder, the local hub cache, else the
    hub's file list). ``ValueError`` for a teacher that exists only once built (tiny, pruned,
    GGUF: its served copy cannot be checked against its config), ``OSError`` when its files
    cannot be read."""
    from transformers import AutoConfig

    from saopd.models.loading import resolve_source

    name = teacher.name_or_path
    if (name is None or teacher.tiny is not None or teacher.prune_every is not None
            or teacher.prune_keep is not None or str(name).lower().endswith(".gguf")):
        raise ValueError(
            "teacher_scoring=vllm_server checks that every server serves the teacher's weight "
            "files, which needs a teacher given as an HF folder or hub id (teacher.name_or_path; "
            "no tiny, pruned or GGUF teacher, which exists only once built): save it "
            "(save_pretrained, with its tokenizer), serve that folder and name it in "
            "teacher.name_or_path")
    source = resolve_source(name, None, kind="model")
    config = AutoConfig.from_pretrained(source.location, revision=teacher.revision,
                                        trust_remote_code=teacher.trust_remote_code)
    return TeacherReference(str(name), config_values(config),
                            weights_digest(source.location, teacher.revision))


class VLLMServerTeacherScorer:
    """``teacher_scoring=vllm_server``: teacher servers (``saopd-serve --model <teacher>``).

    Start-up waits for every server's ``/health``, reads ``/v1/models`` (``model``, or the
    first server's model, which every server must serve; the smallest ``max_model_len``) and
    checks that each server serves the teacher: it tokenizes a probe text as ``tokenizer`` (the
    teacher's) does (``/tokenize``) and, with ``teacher`` (:class:`TeacherReference`), its
    model's config and weight files' digest are the teacher's (``saopd_server_info``,
    ``saopd_server_weights_digest``). Each step's contexts are dealt out over the servers in
    contiguous shares, each share split into ``max_concurrent_requests`` requests
    (``/v1/completions`` with the token-id prompts, ``max_tokens: 1``, ``prompt_logprobs: K``,
    ``return_token_ids``), sent in parallel threads. Every failure raises
    :class:`TeacherServiceError` naming the server. :meth:`from_config` is how ``saopd-train``
    builds it (with the reference).
    """

    name = "vllm_server"
    PROBE_TEXT = "The teacher scores 12 * 7 = 84 tokens, step by step."

    def __init__(self, urls: Sequence[str], *, tokenizer: Any | None = None,
                 teacher: TeacherReference | None = None, model: str | None = None,
                 top_k: int = 0, request_timeout: float = 1800.0,
                 startup_timeout: float = 600.0, max_concurrent_requests: int = 1,
                 api_key_file: str | None = None) -> None:
        if not urls:
            raise ValueError("teacher_scoring=vllm_server needs teacher_scoring.urls")
        self.servers = [_server(u, request_timeout, client_api_key(
            api_key_file, u, "teacher_scoring.api_key_file")) for u in urls]
        self.top_k = int(top_k)
        self.max_concurrent_requests = int(max_concurrent_requests)
        deadline = time.monotonic() + startup_timeout
        for server in self.servers:
            server.wait_healthy(deadline)
        lengths = []
        for server in self.servers:
            got = server.call("GET", "/v1/models")
            cards = got.get("data") if isinstance(got, dict) else None
            if not isinstance(cards, list) or not cards or not all(
                    isinstance(c, dict) and isinstance(c.get("id"), str) for c in cards):
                raise TeacherServiceError(f"teacher server {server.url}: /v1/models answered "
                                          f"{str(got)[:200]}, not a list of models")
            if model is None:
                model = cards[0]["id"]
            card = next((c for c in cards if c["id"] == model), None)
            if card is None:
                raise TeacherServiceError(
                    f"teacher server {server.url} serves {[c['id'] for c in cards]}, not "
                    f"{model!r} (teacher_scoring.model, or the first server's model)")
            lengths.append(int(card.get("max_model_len") or 1 << 30))
        self.model = str(model)
        self.max_model_len = min(lengths)
        if tokenizer is not None:
            want = [int(t) for t in tokenizer(self.PROBE_TEXT, add_special_tokens=False)[
                "input_ids"]]
            for server in self.servers:
                got = server.call("POST", "/tokenize", {"model": self.model,
                                                        "prompt": self.PROBE_TEXT,
                                                        "add_special_tokens": False})
                tokens = got.get("tokens") if isinstance(got, dict) else None
                if tokens != want:
                    raise TeacherServiceError(
                        f"teacher server {server.url} tokenizes a probe text as {tokens}, the "
                        f"teacher's tokenizer as {want}: it does not serve the teacher")
        if teacher is not None:
            for server in self.servers:
                _check_serves(server, teacher)
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

    def _request(self, server: JsonClient, prompts: list[list[int]], k: int
                 ) -> list[tuple[list[int], list[Any]]]:
        body = {"model": self.model, "prompt": prompts, "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": k, "return_token_ids": True, "skip_special_tokens": False}
        got = server.call("POST", "/v1/completions", body)
        choices = got.get("choices") if isinstance(got, dict) else None
        if not isinstance(choices, list) or len(choices) != len(prompts):
            raise TeacherServiceError(f"teacher server {server.url}: /v1/completions answered "
                                      f"{str(got)[:200]}, not {len(prompts)} choices")
        out: list[tuple[list[int], list[Any]]] = [([], [])] * len(prompts)
        for choice in choices:
            i = choice.get("index") if isinstance(choice, dict) else None
            plp = choice.get("prompt_logprobs") if isinstance(choice, dict) else None
            ids = choice.get("prompt_token_ids") if isinstance(choice, dict) else None
            if not isinstance(i, int) or not 0 <= i < len(prompts) or not isinstance(plp, list):
                raise TeacherServiceError(f"teacher server {server.url}: a choice without "
                                          f"prompt log-probs ({str(choice)[:200]})")
            if ids is not None and list(ids) != prompts[i]:
                raise TeacherServiceError(f"teacher server {server.url} scored other prompt ids "
                                          f"than it was sent ({len(ids)} vs {len(prompts[i])})")
            if len(plp) != len(prompts[i]):
                raise TeacherServiceError(f"teacher server {server.url} returned {len(plp)} "
                                          f"prompt log-probs for {len(prompts[i])} tokens")
            out[i] = (prompts[i], plp)
        return out

    def submit(self, batch: PairedContextBatch, needs: ScoringNeeds, *,
               messages: Sequence[Sequence[Mapping[str, Any]]] | None = None
               ) -> PendingTeacherScores:
        k = _top_k_for(needs, self.top_k, "teacher_scoring=vllm_server")
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
        jobs: list[tuple[JsonClient, int, int]] = []
        per = -(-len(sent) // len(self.servers))
        self.last_prompts_per_server = [0] * len(self.servers)
        for s, server in enumerate(self.servers):
            lo, hi = s * per, min(len(sent), (s + 1) * per)
            if lo >= hi:
                continue
            self.last_prompts_per_server[s] = hi - lo
            step = -(-(hi - lo) // self.max_concurrent_requests)
            jobs += [(server, a, min(hi, a + step)) for a in range(lo, hi, step)]
        futures = [self._pool.submit(self._request, server, sent[a:b], k)
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
                rows.append([_json_entry(plp[j]) for j in positions])
            b = targets.shape[0]
            parts = [scores_from_prompt_logprobs(rows[c * b:(c + 1) * b], targets, mask,
                                                 top_k=k, where="teacher server")
                     for c in range(len(contexts))]
            self.last_score_seconds = time.perf_counter() - started
            return _assemble(parts, needs, k)

        return _FutureScores(self._pool.submit(gather))

    def close(self) -> None:
        pool = self.__dict__.pop("_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> VLLMServerTeacherScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_serves(server: JsonClient, teacher: TeacherReference) -> None:
    """``TeacherServiceError`` naming both unless ``server`` serves ``teacher``: its model's
    config and its weight files' digest."""
    info = server.rpc("saopd_server_info")
    served, config = info.get("model"), info.get("config")
    if not isinstance(config, dict):
        raise server.garbage("/collective_rpc saopd_server_info", "the served model's config",
                             info)
    if info.get("broken"):
        raise TeacherServiceError(f"teacher server {server.url}: a weight reload failed there "
                                  f"({info['broken']}); restart it (saopd-serve)")
    differ = config_differences(config, teacher.config, "teacher")
    if differ:
        raise TeacherServiceError(
            f"teacher server {server.url} serves {served!r}, a model that differs from the "
            f"teacher {teacher.name!r}: {', '.join(differ)}; serve the teacher (saopd-serve "
            "--model <teacher.name_or_path>)")
    got = server.rpc("saopd_server_weights_digest")
    if not isinstance(got.get("digest"), str):
        raise TeacherServiceError(f"teacher server {server.url} cannot fingerprint the weights "
                                  f"it serves: {got.get('error') or got}")
    if got["digest"] != teacher.weights.digest:
        raise TeacherServiceError(
            f"teacher server {server.url} serves the weights of {got.get('source')!r} (SHA-256 "
            f"digest {got['digest'][:16]}), not those of the teacher {teacher.name!r} "
            f"({teacher.weights.source}, {teacher.weights.digest[:16]}): another checkpoint of "
            "the same architecture; serve the teacher's folder")


def _json_entry(entry: Any) -> dict[int, float]:
    """``{id: log-prob}`` of one position of a JSON ``prompt_logprobs`` list (``{"<id>":
    {"logprob": x, ...}}``; vLLM writes -inf as -9999)."""
    if not isinstance(entry, dict):
        raise TeacherServiceError(f"a teacher server returned a prompt log-prob entry "
                                  f"{str(entry)[:200]}, not a mapping of token ids")
    out = {}
    for key, value in entry.items():
        lp = value.get("logprob") if isinstance(value, dict) else value
        out[int(key)] = float(lp)
    return out


#: Factories by backend name, for :func:`saopd.train` (``teacher_scoring=<backend>``).
SCORERS: dict[str, Callable[..., TeacherScorer]] = {
    "hf": HFTeacherScorer,
    "vllm": VLLMTeacherScorer,
    "vllm_server": VLLMServerTeacherScorer,
}
