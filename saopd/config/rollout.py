"""Schema of the rollout engines (``conf/rollout/<engine>.yaml``): one dataclass per engine.

:class:`RolloutConfig` holds what every engine shares (sampling); each engine's dataclass adds
its own options and is registered as the schema of its YAML file (``rollout_<engine>_schema`` at
the root of Hydra's config store: :func:`saopd.config.train.rollout_schema_name`), so a key of
one engine given to another is refused by name. The engine
classes (:mod:`saopd.rollout`) take their options from these dataclasses: the defaults live here
only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from saopd.choices import ROLLOUT_SAMPLERS, SYNC_TRANSPORTS
from saopd.config.vllm_engine import VLLMEngineOptions
from saopd.validation import check_choice, check_fraction, check_int, check_number, check_positive

__all__ = ["HFRolloutConfig", "RolloutConfig", "VLLMRolloutConfig", "VLLMServerRolloutConfig"]


@dataclass
class RolloutConfig:
    """Sampling of the student's responses (one call per step), common to every engine.

    Attributes:
        engine: the engine's registry name (``saopd.rollout.ENGINES``); set by the engine's
            YAML file (``rollout=hf`` | ``rollout=vllm``), not meant to be overridden alone.
        n: responses per prompt.
        temperature: sampling temperature. The paper gives sampling settings for evaluation only
            (temperature 1.0, top-p 0.95: ``saopd-eval``), none for training; 1.0 here is our
            choice, the student's own distribution that the on-policy objective assumes.
        top_p: nucleus sampling (1.0 = off; likewise our choice for training, not the paper's).
        max_new_tokens: response length limit.
        greedy: argmax decoding instead of sampling (debugging, evaluation).
        async_steps: 1 = sample step k+1's rollouts while step k trains, from weights one
            optimizer step old (engines with their own weights; the truncated importance ratio
            corrects it; ``train/rollout_staleness`` logs it); 0 (default) = on-policy.
        importance_ratio_cap: the default of the sampled objectives' ``importance_ratio_cap``
            (``conf/objective/{sampled,exopd}.yaml`` read it): the truncated importance ratio
            corrects a sampler/trainer mismatch; null when the sampler is the trained module.
    """

    engine: str = "hf"
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    greedy: bool = False
    importance_ratio_cap: float | None = None
    async_steps: int = 0

    def __post_init__(self) -> None:
        check_int("n", self.n, owner="rollout")
        check_choice("async_steps", self.async_steps, (0, 1), owner="rollout")
        check_int("max_new_tokens", self.max_new_tokens, owner="rollout")
        check_positive("temperature", self.temperature, owner="rollout")
        check_fraction("top_p", self.top_p, owner="rollout")
        if self.importance_ratio_cap is not None:
            check_positive("importance_ratio_cap", self.importance_ratio_cap, owner="rollout")


def _check_engine(engine: str, own: str) -> None:
    if engine != own:
        raise ValueError(f"rollout.engine is {own!r} in conf/rollout/{own}.yaml, got {engine!r}: "
                         "choose the engine with rollout=<engine> (the registered engines: "
                         "saopd.rollout.ENGINES)")


@dataclass
class HFRolloutConfig(RolloutConfig):
    """``rollout=hf``: transformers ``generate`` on the live student (CPU or GPU).

    Attributes:
        batch_size: prompts per ``generate`` call (null = all of the step's prompts).
        sampler: how the lean decode loop draws a token from its probabilities
            (:mod:`saopd.rollout.sampling`): ``multinomial`` (``torch.multinomial``, the tokens
            ``model.generate`` samples for a seed) or ``inverse_cdf`` (one uniform per row: the
            same distribution, another random stream, ~20x cheaper per draw on CPU). Only the
            lean loop (text students of ``LEAN_DECODE_MODEL_TYPES``) can use ``inverse_cdf``.
        static_cache: sample through ``model.generate`` with transformers' static KV cache and
            its compiled decode step (``torch.compile``, CUDA graphs on a GPU) instead of the
            lean loop; the same tokens for a seed as ``generate`` and the same raw log-probs.
            At the paper's shapes on one H100: 2.3-2.5x the lean loop's sampled tokens/s, but
            its first step compiles (18-54 s; docs/benchmarks.md), so it is off by default;
            vLLM remains the GPU engine. ``multinomial`` sampler only.
    """

    engine: str = "hf"
    batch_size: int | None = None
    sampler: str = "multinomial"
    static_cache: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_engine(self.engine, "hf")
        check_int("batch_size", self.batch_size, owner="rollout", allow_none=True)
        check_choice("sampler", self.sampler, ROLLOUT_SAMPLERS, owner="rollout")
        if self.static_cache and self.sampler != "multinomial":
            raise ValueError("rollout.static_cache=true samples through model.generate, which "
                             "draws with multinomial only: set rollout.sampler=multinomial")
        if self.async_steps:
            raise ValueError("rollout.async_steps=1 needs an engine with its own copy of the "
                             "weights (rollout=vllm with rollout.in_process=false, or "
                             "rollout=vllm_server): HF generate samples from the very module "
                             "being trained")


@dataclass
class VLLMRolloutConfig(RolloutConfig, VLLMEngineOptions):
    """``rollout=vllm``: :class:`saopd.vllm.engine.VLLMEngine`, a vLLM copy of the student,
    synced after every optimizer step (needs the ``vllm`` package: docs/vllm.md). The engine's
    options (``dtype``, ``max_model_len``, ``gpu_memory_utilization``, ``kv_cache_gb``,
    ``enforce_eager``, ``tensor_parallel_size``, ``model_dir``, ``max_images_per_prompt``,
    ``startup_timeout``) are :class:`~saopd.config.vllm_engine.VLLMEngineOptions`'.

    Attributes:
        importance_ratio_cap: 5.0: vLLM's sampler and the trainer disagree slightly (kernels,
            precision), so the sampled objectives multiply by ``min(exp(lpS - lp_sampler), 5)``
            (verl, G-OPD); ``objective.importance_ratio_cap=null`` turns it off.
        enable_sleep_mode: GPU only: free the engine's memory during the training step.
        sleep_level: 1 offloads weights to CPU; 2 drops them (reported to return stale weights
            after wake-up: keep ``verify_sync`` on).
        weight_bucket_mb: size of the buckets a weight sync gathers (FSDP) and ships in, MiB.
        sync_transport: ``auto`` | ``iterator`` (tensors through ``collective_rpc``, in-process
            only) | ``files`` (safetensors shards in ``/dev/shm``).
        in_process: engine core in the training process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``);
            with several training processes each rank's engine core always runs in its own
            process, except with ``tensor_parallel_size`` > 1, where it always runs in the
            training process (docs/vllm.md).
        verify_sync: check that every sync landed (cheap sums of embeddings and norms, the
            packed LM head).
    """

    engine: str = "vllm"
    importance_ratio_cap: float | None = 5.0
    enable_sleep_mode: bool = False
    sleep_level: int = 1
    weight_bucket_mb: int = 512
    sync_transport: str = "auto"
    in_process: bool = True
    verify_sync: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_engine(self.engine, "vllm")
        if self.async_steps and self.in_process:
            raise ValueError("rollout.async_steps=1 with rollout=vllm needs "
                             "rollout.in_process=false: the engine samples in a background "
                             "thread while the step trains, and an in-process CPU engine shares "
                             "torch's thread settings with the trainer")
        self.check_engine_options("rollout")
        check_choice("sleep_level", self.sleep_level, (1, 2), owner="rollout")
        check_int("weight_bucket_mb", self.weight_bucket_mb, owner="rollout")
        check_choice("sync_transport", self.sync_transport, SYNC_TRANSPORTS, owner="rollout")


@dataclass
class VLLMServerRolloutConfig(RolloutConfig):
    """``rollout=vllm_server``: :class:`saopd.vllm.client.rollout.VLLMServerEngine`, rollouts
    from one or more vLLM servers started with ``saopd-serve`` (no ``vllm`` package needed in
    the training environment), synced after every optimizer step through safetensors shards.

    Attributes:
        importance_ratio_cap: 5.0, as ``rollout=vllm`` (the servers' kernels and precision differ
            from the trainer's).
        urls: the servers' base URLs (``[http://127.0.0.1:8000]``; at least one, checked when
            the engine starts); each step's prompts are spread over them.
        model: the model id the servers must list in ``/v1/models`` (``saopd-serve --model`` or
            its ``--served-model-name``); null = whatever the first server serves, the same on
            every server.
        weights_dir: the folder global rank 0 writes the student's shards to after every step;
            every server must read it (null = a temporary folder in ``/dev/shm``: one node only;
            across nodes a shared file system).
        weight_bucket_mb: size of the buckets a sync gathers (FSDP) and the shards it writes, MiB.
        verify_sync: compare per-tensor sums computed by every server with what was sent.
        startup_timeout: seconds to wait for every server's ``/health`` at start-up.
        request_timeout: seconds one HTTP request (a prompt's sampling, a reload) may take before
            the run stops naming the server.
        max_concurrent_requests: prompts in flight per server (each prompt is one request).
        api_key_file: a file holding the servers' API key (the one ``saopd-serve`` printed;
            readable by its owner only); null = ``SAOPD_SERVE_API_KEY``, else for a server on
            this machine its default key file. Only the path is in the config: the key is never
            logged.
    """

    engine: str = "vllm_server"
    importance_ratio_cap: float | None = 5.0
    urls: list[str] = field(default_factory=list)
    model: str | None = None
    weights_dir: str | None = None
    weight_bucket_mb: int = 512
    verify_sync: bool = True
    startup_timeout: float = 600.0
    request_timeout: float = 1800.0
    max_concurrent_requests: int = 64
    api_key_file: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_engine(self.engine, "vllm_server")
        urls = list(self.urls or [])  # empty is refused when the engine starts
        for url in urls:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"rollout.urls: {url!r} is not an http(s) URL")
        if len({u.rstrip("/") for u in urls}) != len(urls):
            raise ValueError(f"rollout.urls lists a server more than once: {urls}")
        check_int("weight_bucket_mb", self.weight_bucket_mb, owner="rollout")
        check_number("startup_timeout", self.startup_timeout, low=0.0, owner="rollout")
        check_number("request_timeout", self.request_timeout, low=0.0, owner="rollout")
        check_int("max_concurrent_requests", self.max_concurrent_requests, owner="rollout")
