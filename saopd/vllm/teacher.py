"""``teacher_scoring=vllm``: the teacher's log-probs from a ``vllm.LLM`` of the teacher, started
by the trainer.

:class:`VLLMTeacherScorer` meets the :class:`~saopd.scoring.teacher_service.TeacherScorer`
contract. Its engine core runs in its own process by default, so the teacher computes while the
trainer computes (on GPU on its own devices, ``teacher_scoring.devices``). Each step's contexts go
in as token-id prompts and the response tokens' log-probs come back from vLLM's
``prompt_logprobs`` (:mod:`saopd.vllm.prompt_logprobs`), in one worker thread. Vision-language
pairs: each context goes with one ``<|image_pad|>`` per image and the row's images as
``multi_modal_data``; vLLM expands the images and its expanded ids must equal saopd's
(``RuntimeError`` otherwise: the processors disagree), as the rollout engine checks.

``vllm`` is imported on first use. The process care around the engine (RNG and thread state
around vLLM's start-up, the launcher variables a clean engine-core start drops, the KV cache on
CPU) is :mod:`saopd.vllm.runtime`'s, its shutdown :mod:`saopd.vllm.shutdown`'s.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from saopd.contexts.batch import ContextBatch, PairedContextBatch
from saopd.scoring.passes import PendingTeacherScores, ScoringNeeds, TeacherScores
from saopd.scoring.teacher_service import FutureTeacherScores
from saopd.vllm.client.teacher_server import TeacherServiceError
from saopd.vllm.prompt_logprobs import (
    assemble_scores,
    collapse_images,
    context_prompts,
    context_scores,
    response_token_index,
    top_k_for,
)
from saopd.vllm.runtime import (
    LAUNCHER_VARIABLES,
    cpu_kv_cache_bytes,
    preserve_process_state,
    require_vllm,
    temporary_environ,
)
from saopd.vllm.shutdown import Closing, remove_folder, shutdown_llm, stop_pool

__all__ = ["VLLMTeacherScorer"]


class VLLMTeacherScorer(Closing):
    """``teacher_scoring=vllm``: a ``vllm.LLM`` of the teacher folder ``model_dir``.

    Args:
        model_dir: an HF model folder (or hub id) of the teacher, with its tokenizer.
        top_k: the top-k approximation's K (module docstring); 0 = sampled tokens only.
        dtype, max_model_len, gpu_memory_utilization, kv_cache_gb, enforce_eager,
        tensor_parallel_size: the engine's (``vllm.LLM``'s) options. On vLLM's CPU backend
            with no ``kv_cache_gb`` the KV cache is sized from the free memory and the model
            (:func:`~saopd.vllm.runtime.cpu_kv_cache_bytes`), or the engine is refused
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
        self._in_process = bool(in_process)
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
                rows.append(plp)
            parts = context_scores(
                rows, index, targets, mask, top_k=k, where="teacher vLLM engine",
                entry=lambda e: {int(t): float(v.logprob) for t, v in e.items()},
                error=TeacherServiceError)
            self.last_score_seconds = time.perf_counter() - started
            return assemble_scores(parts, needs, k)

        return FutureTeacherScores(self._pool.submit(run))

    def close(self) -> None:
        """Shut the engine down (and remove an owned model folder)."""
        stop_pool(self.__dict__.pop("_pool", None), wait=True)
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            # an engine core in this process set vLLM's distributed state up here: it goes
            # too, so that another in-process engine can start after this one
            shutdown_llm(llm, distributed="all" if self._in_process else "none")
            del llm
        if self._owned_dir:
            remove_folder(self.model_dir)
            self._owned_dir = False
