"""A rollout engine on vLLM servers (``rollout=vllm_server``): sampling over HTTP, synced by files.

:class:`VLLMServerEngine` samples from one or more vLLM servers started with ``saopd-serve``
(:mod:`saopd.vllm.server.cli`: vLLM's OpenAI-compatible server with its dev-mode endpoints and
saopd's worker extension, :class:`~saopd.vllm.worker.SaopdWorkerExtension`), listed in
``rollout.urls``. The training process imports no ``vllm``: it speaks HTTP (``urllib``, no
proxies) and JSON.

Sampling (:meth:`VLLMServerEngine.generate`) matches :class:`~saopd.vllm.engine.VLLMEngine`:
the same chat rendering and prompt limit (:func:`~saopd.rollout.base.limit_prompts`: truncate /
error / skip, with the same counts); one ``POST /v1/completions`` per kept prompt whose
``prompt`` is exactly the token ids saopd rendered (so scoring sees what was sampled), with
``n``, temperature and top-p (top-k, min-p and penalties off), the stop tokens
(:func:`~saopd.rollout.base.default_stop_token_ids`), ``logprobs: 0`` (the sampled token's raw
log-prob: the server must run vLLM's default ``--logprobs-mode raw_logprobs``, which start-up
checks), ``return_token_ids`` and, with a seed, ``seed + i * n`` for the prompt of index ``i``
(vLLM gives its ``j``-th sample ``seed + i * n + j``). A prompt is sampled by one server; the
kept prompts are dealt out over the servers in turn (shifted by the global rank, so that ranks
with few prompts do not all start on the first server), at most ``max_concurrent_requests`` in
flight per server. With the same weights a sample does not depend on which server drew it.

Weight sync (:meth:`VLLMServerEngine.load_weights`, after every optimizer step and once at the
start, on every rank): every rank iterates the student's full parameter set bucket by bucket
(:func:`~saopd.vllm.sync.iter_with_sums`; FSDP2 DTensors are gathered with
``full_tensor()``, a collective), global rank 0 writes the tensors as safetensors shards
(:func:`~saopd.vllm.sync.write_shards`, in the servers' dtype) to a folder under
``rollout.weights_dir`` that every server can read, and then, for every server in parallel:
checks it is the server met at start-up, has it reload the folder (``POST /collective_rpc``
``saopd_server_reload``: vLLM's ``reload_weights(weights_path=...)``, the tied LM heads
repacked), resets its prefix cache (``POST /reset_prefix_cache``) and, with ``verify_sync``,
compares the float64 sums the server computes of the tensors it stores unchanged (norms;
embeddings and LM heads over the rows of the student's vocabulary, vLLM pads it) with the sums
of what was sent, and checks its packed LM head. Rank 0 then broadcasts the
outcome (a barrier with the error, when there is one, so no rank waits forever or samples stale
weights).

Start-up (the constructor) waits for every server's ``GET /health`` (``startup_timeout``), then
checks each server through its client (:mod:`saopd.vllm.client.rollout_server`: the served
model and the smallest ``max_model_len``, who the server is, its config against the student's,
its weights folder, which of its tensors it stores under the checkpoint's names and shapes).
The first sync writes a probe file to the weights folder and has every server answer its
digest, so a folder a server cannot see is reported at once.

Every failure names the server (:class:`~saopd.vllm.client.rollout_server.RolloutServerError`).
Not supported yet: vision-language students (use ``rollout=vllm``), servers with sleep mode.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from saopd import data_parallel as dp
from saopd.choices import LONG_PROMPT_MODES
from saopd.config.rollout import VLLMServerRolloutConfig
from saopd.prompts.render import render_prompt_ids
from saopd.rollout.base import (
    Message,
    Rollout,
    RolloutBatch,
    SamplingParams,
    check_context_fits,
    default_stop_token_ids,
    limit_prompts,
    refuse_images,
)
from saopd.rollout.registry import EngineSetup
from saopd.validation import check_choice, check_int, check_number
from saopd.vllm.client.rollout_server import (
    RolloutServerError,
    ServerClient,
    check_models,
    json_number,
)
from saopd.vllm.sampling import checked_rollout
from saopd.vllm.scratch import SYNC_PREFIX, owned_dir, remove_stale_dirs, shm_dir
from saopd.vllm.server.auth import client_api_key
from saopd.vllm.shutdown import Closing, remove_folder, stop_pool
from saopd.vllm.sync import (
    canonical_weight_name,
    checked_weights,
    iter_with_sums,
    write_shards,
)
from saopd.vllm.worker import PROBE_FILE

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["VLLMServerEngine"]

log = logging.getLogger(__name__)

_DEFAULTS = VLLMServerRolloutConfig  # the engine's option defaults are the config schema's

def _share_outcome(failure: BaseException | None, rank: int, world: int) -> str | None:
    """Rank 0's failure message (None = success) on every rank: a broadcast, so the ranks also
    wait for rank 0's sync (a barrier) and none waits forever when it failed."""
    if world == 1:
        return None
    box: list[Any] = [None if failure is None else f"{type(failure).__name__}: {failure}"]
    torch.distributed.broadcast_object_list(box, src=0)
    return None if rank == 0 else box[0]


def _drain(stream: Iterable[Any]) -> None:
    """Consume ``stream`` (its DTensor gathers are collectives the other ranks take part in)."""
    for _ in stream:
        pass


class VLLMServerEngine(Closing):
    """Samples rollouts from ``saopd-serve`` servers; synced by ``load_weights`` (module
    docstring). The constructor connects to the servers and checks them.

    Args:
        urls: the servers' base URLs (at least one).
        tokenizer: the student's tokenizer (chat template).
        expected_weights: ``{HF name: shape}`` that ``load_weights`` must receive (the student's
            parameters, tied ones once).
        stop_token_ids: stop tokens (at least one; the student's
            :func:`~saopd.rollout.base.default_stop_token_ids`).
        model_config: the student's ``transformers`` config: its
            :data:`~saopd.vllm.identity.CONFIG_KEYS` values must equal the servers' (None =
            not compared).
        model: the model id the servers must list in ``/v1/models`` (None = the first
            server's first model, which every server must list).
        weights_dir: parent folder of the sync shards, readable by every server (None =
            ``/dev/shm`` where the machine has it, else the temporary folder).
        weight_bucket_mb, verify_sync, startup_timeout, request_timeout,
        max_concurrent_requests, api_key_file: as in
            :class:`~saopd.config.rollout.VLLMServerRolloutConfig`.
        max_prompt_length, prompt_truncation, greedy, chat_template_kwargs: as in
            :class:`~saopd.rollout.hf.HFGenerateEngine`.
    """

    name = "vllm_server"  # its registry name (saopd.rollout.adapters)
    holds_weights = True  # needs load_weights after every optimizer step

    def __init__(
        self,
        urls: Sequence[str],
        tokenizer: PreTrainedTokenizerBase,
        *,
        expected_weights: Mapping[str, Sequence[int]],
        stop_token_ids: Sequence[int],
        model_config: Any | None = None,
        model: str | None = _DEFAULTS.model,
        weights_dir: str | Path | None = _DEFAULTS.weights_dir,
        weight_bucket_mb: int = _DEFAULTS.weight_bucket_mb,
        verify_sync: bool = _DEFAULTS.verify_sync,
        startup_timeout: float = _DEFAULTS.startup_timeout,
        request_timeout: float = _DEFAULTS.request_timeout,
        max_concurrent_requests: int = _DEFAULTS.max_concurrent_requests,
        api_key_file: str | None = _DEFAULTS.api_key_file,
        max_prompt_length: int | None = None,
        prompt_truncation: str = "truncate",
        greedy: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(urls, str) or not urls:
            raise ValueError("rollout.urls must list at least one server, e.g. "
                             "rollout.urls=[http://127.0.0.1:8000] (saopd-serve prints its URL)")
        stripped = [str(u).rstrip("/") for u in urls]
        if len(set(stripped)) != len(stripped):
            raise ValueError(f"rollout.urls lists a server more than once: {list(urls)}")
        check_choice("prompt_truncation", prompt_truncation, LONG_PROMPT_MODES,
                     owner="VLLMServerEngine")
        for name, flag in (("greedy", greedy), ("verify_sync", verify_sync)):
            if not isinstance(flag, bool):
                raise ValueError(f"VLLMServerEngine.{name} must be a bool, got {flag!r}")
        check_int("max_prompt_length", max_prompt_length, owner="VLLMServerEngine",
                  allow_none=True)
        check_int("weight_bucket_mb", weight_bucket_mb, owner="VLLMServerEngine")
        check_int("max_concurrent_requests", max_concurrent_requests, owner="VLLMServerEngine")
        check_number("startup_timeout", startup_timeout, low=0.0, owner="VLLMServerEngine")
        check_number("request_timeout", request_timeout, low=0.0, owner="VLLMServerEngine")
        stop = tuple(dict.fromkeys(int(t) for t in stop_token_ids))
        if not stop:
            raise ValueError("VLLMServerEngine.stop_token_ids must list at least one id")

        self.tokenizer = tokenizer
        self.clients = [ServerClient(u, request_timeout,
                                     client_api_key(api_key_file, u, "rollout.api_key_file"))
                        for u in urls]
        self.expected_weights: dict[str, tuple[int, ...]] = {
            k: tuple(v) for k, v in expected_weights.items()}
        self.stop_token_ids: tuple[int, ...] = stop
        self.max_prompt_length = max_prompt_length
        self.prompt_truncation = prompt_truncation
        self.greedy = greedy
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        # where the shards go: every server must read its sync folders from there
        self._parent = (self.weights_dir if self.weights_dir is not None
                        else shm_dir() or Path(tempfile.gettempdir())).resolve()
        self.weight_bucket_bytes = weight_bucket_mb << 20
        self.verify_sync = verify_sync
        self.max_concurrent_requests = max_concurrent_requests
        self.last_sync_seconds: float | None = None  # the last load_weights, all of it
        self.last_write_seconds: float | None = None  # its shard writing (rank 0)
        self.last_reload_seconds: float | None = None  # its reloads, resets and checks (rank 0)
        self.last_sync_checked = 0  # tensors compared per server by the last verification
        self.last_prompts_per_server: list[int] = [0] * len(self.clients)
        self._sync_dir: Path | None = None

        started = time.perf_counter()
        deadline = time.monotonic() + startup_timeout
        for client in self.clients:  # the servers start in parallel: one deadline for all
            client.wait_healthy(deadline)
        self.model, self.max_model_len = check_models(self.clients, model)
        self._identity: dict[str, tuple[str, int]] = {}
        dtype_of: dict[str, str] = {}
        for client in self.clients:
            info = client.checked_info(self._parent)
            self._identity[client.url] = (info["instance"], info["pid"])
            dtype_of[client.url] = info["dtype"]
            client.check_config(info, self.model, model_config)
        if len(set(dtype_of.values())) != 1:
            raise RolloutServerError(
                "the rollout servers run different dtypes "
                f"({', '.join(f'{c.url}: {dtype_of[c.url]}' for c in self.clients)}); "
                "start them all with the same --dtype")
        self.dtype: torch.dtype = getattr(torch, dtype_of[self.clients[0].url])
        # HF name -> served name of the tensors stored unchanged: what verification compares
        self._verify_names: dict[str, str] = {}
        # served name -> the student's vocabulary rows of a tensor whose vocabulary vLLM padded
        self._rows: dict[str, int] = {}
        for client in self.clients:
            names, rows = client.comparable_names(self.expected_weights, self.model)
            if self._verify_names and (names, rows) != (self._verify_names, self._rows):
                raise RolloutServerError(
                    f"rollout server {client.url} stores the student's tensors differently from "
                    f"{self.clients[0].url}: the servers serve different models")
            self._verify_names, self._rows = names, rows
        log.info("rollout servers ready in %.1f s: %s serving %r (%s, max_model_len %d)",
                 time.perf_counter() - started, ", ".join(c.url for c in self.clients),
                 self.model, str(self.dtype).removeprefix("torch."), self.max_model_len)

    # ------------------------------------------------------------------------------------------
    # construction from a live model

    @classmethod
    def from_config(cls, conf: VLLMServerRolloutConfig, student: PreTrainedModel,
                    tokenizer: PreTrainedTokenizerBase, setup: EngineSetup
                    ) -> VLLMServerEngine:
        """The engine ``rollout=vllm_server`` builds
        (:func:`saopd.rollout.registry.build_engine`); any number of training processes
        (each rank samples its own prompts, rank 0 syncs). ``ValueError`` for a
        vision-language student (not supported yet: ``rollout=vllm``)."""
        if setup.processor is not None:
            raise ValueError("rollout=vllm_server samples text only for now; a vision-language "
                             "student needs rollout=vllm")
        expected = {canonical_weight_name(n): tuple(p.shape)
                    for n, p in student.named_parameters()}
        return cls(
            list(conf.urls), tokenizer, expected_weights=expected,
            stop_token_ids=default_stop_token_ids(tokenizer, student),
            model_config=getattr(student, "config", None), model=conf.model,
            weights_dir=conf.weights_dir, weight_bucket_mb=conf.weight_bucket_mb,
            verify_sync=conf.verify_sync, startup_timeout=conf.startup_timeout,
            request_timeout=conf.request_timeout,
            max_concurrent_requests=conf.max_concurrent_requests,
            api_key_file=conf.api_key_file, greedy=conf.greedy,
            max_prompt_length=setup.max_prompt_length, prompt_truncation=setup.prompt_truncation,
            chat_template_kwargs=setup.chat_template_kwargs)

    # ------------------------------------------------------------------------------------------
    # generate

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The chat prompt rendered with the generation prompt, before any truncation."""
        return render_prompt_ids(self.tokenizer, messages, add_generation_prompt=True,
                                 chat_template_kwargs=self.chat_template_kwargs)

    def request_body(self, ids: Sequence[int], sampling: SamplingParams,
                     prompt_index: int) -> dict[str, Any]:
        """The ``/v1/completions`` body of one prompt (token ids) of a ``generate`` call."""
        seed = None if sampling.seed is None else sampling.seed + prompt_index * sampling.n
        body: dict[str, Any] = {
            "model": self.model, "prompt": [int(t) for t in ids], "n": sampling.n,
            "max_tokens": sampling.max_new_tokens,
            "temperature": 0.0 if self.greedy else sampling.temperature,
            "top_p": 1.0 if self.greedy else sampling.top_p,
            "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "logprobs": 0, "stop_token_ids": list(self.stop_token_ids),
            "return_token_ids": True, "skip_special_tokens": False, "ignore_eos": False,
        }
        if seed is not None:
            body["seed"] = seed
        return body

    def generate(self, messages: Sequence[list[Message]], sampling: SamplingParams
                 ) -> RolloutBatch:
        """Sample ``sampling.n`` responses for each chat prompt (grouped by prompt, in order).

        Returns a :class:`RolloutBatch` like :class:`~saopd.vllm.engine.VLLMEngine`'s: each
        response has 1 to ``max_new_tokens`` token ids, ends with its first stop token when
        ``finished``, carries its raw sampler log-probs and the prompt ids it was sampled from.
        ``ValueError`` when a kept prompt plus ``max_new_tokens`` exceeds the servers'
        ``max_model_len``; ``RolloutServerError`` naming the server that failed.
        """
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if isinstance(messages, (str, Mapping)):
            raise TypeError("messages must be a sequence of chats (lists of message dicts)")
        chats = [list(chat) for chat in messages]
        refuse_images(chats)
        kept, truncated, skipped = limit_prompts([self.prompt_ids(c) for c in chats],
                                                 self.max_prompt_length, self.prompt_truncation)
        batch = RolloutBatch(messages=chats, num_truncated_prompts=truncated,
                             num_skipped_prompts=skipped)
        self.last_prompts_per_server = [0] * len(self.clients)
        if not kept:
            return batch
        check_context_fits(kept, sampling.max_new_tokens, self.max_model_len,
                           engine="the rollout servers'",
                           fix="start them with a larger --max-model-len or lower "
                               "data.max_prompt_length / max_new_tokens")
        for client in self.clients:
            client.check_identity(self._identity[client.url])
        rank = dp.rank()
        owners = [self.clients[(k + rank) % len(self.clients)] for k in range(len(kept))]
        for owner in owners:
            self.last_prompts_per_server[self.clients.index(owner)] += 1
        slots = {c.url: threading.Semaphore(self.max_concurrent_requests) for c in self.clients}

        def sample(k: int) -> list[Rollout]:
            index, ids = kept[k]
            client = owners[k]
            with slots[client.url]:
                answer = client.complete(self.request_body(ids, sampling, index))
            return self._rollouts(client, answer, index, ids, sampling.n)

        workers = min(len(kept), self.max_concurrent_requests * len(self.clients))
        for rollouts in _map_in_threads(sample, range(len(kept)), workers):
            batch.rollouts.extend(rollouts)
        return batch

    def _rollouts(self, client: ServerClient, answer: Mapping[str, Any], index: int,
                  ids: list[int], n: int) -> list[Rollout]:
        """The ``n`` rollouts of one completion answer, checked."""
        where = "/v1/completions"
        choices = answer["choices"]
        if len(choices) != n or not all(isinstance(c, dict) for c in choices) or sorted(
                c.get("index") for c in choices if isinstance(c.get("index"), int)) != list(
                range(n)):
            raise client.garbage(where, f"{n} choices indexed 0..{n - 1} (prompt {index})",
                                 answer)
        stop = set(self.stop_token_ids)
        out = []
        for choice in sorted(choices, key=lambda c: c["index"]):
            tokens = choice.get("token_ids")
            logprobs = choice.get("logprobs")
            values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
            if (not isinstance(tokens, list) or not tokens
                    or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                               for t in tokens)
                    or not isinstance(values, list) or len(values) != len(tokens)):
                raise client.garbage(where, "response token ids with one log-prob each "
                                     f"(prompt {index})", choice)
            prompt = choice.get("prompt_token_ids", answer.get("prompt_token_ids"))
            if prompt is not None and list(prompt) != list(ids):
                raise RolloutServerError(
                    f"rollout server {client.url} sampled prompt {index} from other prompt ids "
                    f"than it was sent ({len(prompt)} vs {len(ids)} tokens)")
            out.append(checked_rollout(
                index, ids, tokens, [json_number(v) for v in values], stop,
                source=f"rollout server {client.url}", sample=choice["index"],
                dtype=str(self.dtype).removeprefix("torch.")))
        return out

    # ------------------------------------------------------------------------------------------
    # weights

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Make every server sample from these weights from now on (module docstring).

        Call it on every rank with the same parameters in the same order (FSDP2 gathers are
        collectives): ``named_tensors`` as for :meth:`~saopd.vllm.engine.VLLMEngine.load_weights`
        (full set, HF names, DTensors allowed; checked before anything is written:
        ``ValueError``). Global rank 0 writes the shards and drives the servers; every rank
        then raises the same error when any of it failed (``RolloutServerError`` naming the
        server, ``RuntimeError`` for a sync check that failed). ``last_sync_seconds``,
        ``last_write_seconds`` and ``last_reload_seconds`` record the times.
        """
        started = time.perf_counter()
        items = checked_weights(named_tensors, self.expected_weights)
        rank, world = dp.rank(), dp.world_size()
        sums: dict[str, float] = {}
        stream = iter_with_sums(items, self.weight_bucket_bytes, self.dtype,
                                self._verify_names if self.verify_sync else (), sums)
        failure: BaseException | None = None
        if rank == 0:
            try:
                folder = self._folder()
                write_shards(stream, folder, self.dtype, self.weight_bucket_bytes)
                self.last_write_seconds = time.perf_counter() - started
                reload_started = time.perf_counter()
                self._reload_all(folder, sums)
                self.last_reload_seconds = time.perf_counter() - reload_started
            except Exception as err:
                failure = err
                with contextlib.suppress(Exception):
                    _drain(stream)  # meet the other ranks' gathers
        else:
            _drain(stream)
        message = _share_outcome(failure, rank, world)
        if failure is not None:
            raise failure
        if message is not None:
            raise RolloutServerError(f"the weight sync of global rank 0 failed: {message}")
        self.last_sync_seconds = time.perf_counter() - started

    def _folder(self) -> Path:
        """Rank 0's shard folder (created on first use under ``weights_dir``, removed at exit;
        the stale folders of dead runs there removed first), checked to be readable by every
        server with a probe file (the server answers the file's digest, never its text)."""
        if self._sync_dir is not None:
            return self._sync_dir
        remove_stale_dirs(self._parent)
        folder = owned_dir(SYNC_PREFIX, self._parent)
        atexit.register(remove_folder, folder)
        token = uuid.uuid4().hex
        (folder / PROBE_FILE).write_text(token)
        digest = hashlib.sha256(token.encode()).hexdigest()
        try:
            for client in self.clients:
                client.read_probe(folder, digest)
        except BaseException:
            remove_folder(folder)
            raise
        (folder / PROBE_FILE).unlink()
        self._sync_dir = folder
        return folder

    def _reload_all(self, folder: Path, sums: Mapping[str, float]) -> None:
        """Every server (in parallel): same instance, reload ``folder``, reset the prefix
        cache, check the sums; the failures of all servers in one error."""

        def one(client: ServerClient) -> BaseException | None:
            try:
                client.check_identity(self._identity[client.url])
                client.reload(folder)
                client.reset_prefix_cache()
                if self.verify_sync:
                    self.last_sync_checked = client.check_sums(sums, self._verify_names,
                                                               self._rows)
                return None
            except Exception as err:
                return err

        errors = [e for e in _map_in_threads(one, self.clients, len(self.clients))
                  if e is not None]
        if len(errors) == 1:
            raise errors[0]
        if errors:
            kind = (RuntimeError if all(isinstance(e, RuntimeError) for e in errors)
                    else RolloutServerError)
            raise kind(f"weight sync failed on {len(errors)} rollout servers: "
                       + " | ".join(str(e) for e in errors))

    # ------------------------------------------------------------------------------------------
    # lifetime

    def close(self) -> None:
        """Remove the shard folder (the servers keep running: they are not the engine's)."""
        remove_folder(self._sync_dir)
        self._sync_dir = None


def _map_in_threads(fn: Callable[[Any], Any], items: Iterable[Any], workers: int) -> list[Any]:
    """``fn`` over ``items`` in up to ``workers`` threads; the results in order. The first
    error (whichever call raises it first) cancels the calls not yet started and is raised
    at once, without waiting for the calls still running."""
    items = list(items)
    if workers <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="saopd-rollout")
    try:
        futures = [pool.submit(fn, item) for item in items]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            if future in done and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
        return [future.result() for future in futures]
    finally:
        stop_pool(pool, wait=False)
