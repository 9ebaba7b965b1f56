"""``teacher_scoring=vllm_server``: the teacher's log-probs from ``saopd-serve`` servers of the
teacher, over HTTP (``/v1/completions``); the trainer imports no ``vllm``.

:class:`VLLMServerTeacherScorer` meets the :class:`~saopd.scoring.teacher_service.TeacherScorer`
contract. At start-up every server must prove it serves the teacher
(:mod:`saopd.vllm.client.teacher_server`): the same architecture and sizes, the same
tokenization of a probe text and the same weight files (their SHA-256 digest, computed where the
files are); a server of another model or checkpoint is refused, naming both. Each step's
contexts go out as token-id prompts and the response tokens' log-probs come back from vLLM's
``prompt_logprobs`` as JSON (:mod:`saopd.vllm.prompt_logprobs`). Text contexts only.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from saopd.contexts.batch import PairedContextBatch
from saopd.scoring.passes import PendingTeacherScores, ScoringNeeds, TeacherScores
from saopd.scoring.teacher_service import FutureTeacherScores
from saopd.vllm.client.teacher_server import (
    TeacherReference,
    TeacherServerClient,
    TeacherServiceError,
    teacher_reference,
)
from saopd.vllm.prompt_logprobs import (
    assemble_scores,
    context_prompts,
    context_scores,
    json_entry,
    response_token_index,
    top_k_for,
)
from saopd.vllm.server.auth import client_api_key
from saopd.vllm.shutdown import Closing, stop_pool

if TYPE_CHECKING:
    from saopd.config.model import ModelConfig
    from saopd.config.teacher_scoring import TeacherScoringConfig

__all__ = ["VLLMServerTeacherScorer"]


class VLLMServerTeacherScorer(Closing):
    """``teacher_scoring=vllm_server``: teacher servers (``saopd-serve --model <teacher>``).

    Start-up waits for every server's ``/health``, reads ``/v1/models`` (``model``, or the
    first server's model, which every server must serve; the smallest ``max_model_len``) and
    checks that each server serves the teacher
    (:class:`~saopd.vllm.client.teacher_server.TeacherServerClient`): it tokenizes a probe text as
    ``tokenizer`` (the teacher's) does (``/tokenize``) and, with ``teacher``
    (:class:`~saopd.vllm.client.teacher_server.TeacherReference`), its model's config and weight
    files' digest are the teacher's (``saopd_server_info``, ``saopd_server_weights_digest``).
    Each step's contexts are dealt out over the servers in contiguous shares, each share split
    into ``max_concurrent_requests`` requests (one ``/v1/completions`` of token-id prompts
    each, :meth:`~saopd.vllm.client.teacher_server.TeacherServerClient.prompt_logprobs`), sent in
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
            parts = context_scores(
                [plp for _, plp in answers], index, targets, mask, top_k=k,
                entry=lambda e: json_entry(e, TeacherServiceError), where="teacher server",
                error=TeacherServiceError)
            self.last_score_seconds = time.perf_counter() - started
            return assemble_scores(parts, needs, k)

        return FutureTeacherScores(self._pool.submit(gather))

    def close(self) -> None:
        """Stop the request threads (the servers keep running: they are not the scorer's)."""
        stop_pool(self.__dict__.pop("_pool", None), wait=False)
