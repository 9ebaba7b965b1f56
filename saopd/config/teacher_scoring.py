"""Schema of the teacher-scoring backend (``conf/teacher_scoring/<backend>.yaml``).

``teacher_scoring=hf`` (the default) scores the teacher inside the trainer, exactly and with
everything an objective may ask for; ``vllm`` and ``vllm_server`` score the teacher's full and
residual contexts on a vLLM engine of the teacher (in this process's engine core, or on servers
started with ``saopd-serve``) from their ``prompt_logprobs``, and the trainer holds no teacher
weights (``docs/teacher_scoring.md``). One dataclass for the three: the options of one backend
given to another are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from saopd.config.vllm_engine import VLLMEngineOptions, engine_option_names
from saopd.validation import check_choice, check_int, check_number

__all__ = ["TEACHER_SCORING_BACKENDS", "TeacherScoringConfig"]

#: The teacher-scoring backends (``teacher_scoring=<backend>``).
TEACHER_SCORING_BACKENDS = ("hf", "vllm", "vllm_server")

#: The options each backend reads beyond ``backend`` and ``top_k`` (the others must keep their
#: defaults under it).
_ENGINE_OPTIONS = (*engine_option_names(), "in_process", "devices")
_SERVER_OPTIONS = ("urls", "model", "request_timeout", "startup_timeout",
                   "max_concurrent_requests", "api_key_file")
BACKEND_OPTIONS: dict[str, tuple[str, ...]] = {
    "hf": (),
    "vllm": _ENGINE_OPTIONS,
    "vllm_server": _SERVER_OPTIONS,
}


@dataclass
class TeacherScoringConfig(VLLMEngineOptions):
    """Where the teacher's log-probs of the step's full and residual contexts come from. The
    ``vllm`` backend's engine options (``dtype``: ``auto`` = the teacher config's dtype,
    ``max_model_len``, ``gpu_memory_utilization``, ``kv_cache_gb``, ``enforce_eager``,
    ``tensor_parallel_size``, ``model_dir``, ``max_images_per_prompt``, ``startup_timeout``,
    which ``vllm_server`` reads too) are :class:`~saopd.config.vllm_engine.VLLMEngineOptions`'.

    Attributes:
        backend: ``hf`` (in the trainer: chunked scoring of the teacher's module; exact, every
            signal) | ``vllm`` (a vLLM engine of the teacher started by the trainer: its engine
            core in its own process by default, on its own GPUs with ``devices``) |
            ``vllm_server`` (``saopd-serve`` servers of the teacher listed in ``urls``). The
            vLLM backends return the sampled tokens' log-probs (``prompt_logprobs``); what
            needs more (the exact KL of ``objective=full_kl`` and TIP, the teacher's entropy of
            FiRe and entropy_aware, top-k lists) is refused at start-up unless ``top_k`` asks
            for the documented top-k approximation.
        top_k: 0 = sampled-token log-probs only. K > 0 (vLLM backends): the teacher's top-K
            log-probs at every response position come back too (``prompt_logprobs=K``); they
            serve the teacher-top-k fields of objectives with a top-k of at most K (exact: the
            teacher's own top-K) and the teacher's entropy, approximated over the top K plus one
            bucket for the rest of the vocabulary (a lower bound). Never used unless set.
        in_process (vllm): run the engine core in the training process (the default runs it
            in its own process, so the teacher scores while the student's passes run; an
            in-process teacher cannot share the process with an in-process ``rollout=vllm``).
        devices (vllm): the GPUs of the teacher engine, as ``CUDA_VISIBLE_DEVICES`` of its
            engine core (``"1"``, ``"2,3"``); null = the process's. Needs ``in_process=false``.
        urls (vllm_server): the teacher servers' base URLs; each step's contexts are split
            over them, one request per server.
        model (vllm_server): the model id the servers must list in ``/v1/models`` (null = the
            first server's, the same on all).
        request_timeout (vllm_server): seconds one scoring request may take.
        max_concurrent_requests (vllm_server): requests in flight per server (a step's share
            of a server is split into this many requests).
        api_key_file (vllm_server): a file holding the servers' API key (the one
            ``saopd-serve`` printed; readable by its owner only); null =
            ``SAOPD_SERVE_API_KEY``, else for a server on this machine its default key file.
            Only the path is in the config: the key is never logged.
    """

    backend: str = "hf"
    top_k: int = 0
    in_process: bool = False
    devices: str | None = None
    urls: list[str] = field(default_factory=list)
    model: str | None = None
    request_timeout: float = 1800.0
    max_concurrent_requests: int = 1
    api_key_file: str | None = None

    def __post_init__(self) -> None:
        check_choice("backend", self.backend, TEACHER_SCORING_BACKENDS, owner="teacher_scoring")
        check_int("top_k", self.top_k, owner="teacher_scoring", minimum=0)
        if self.top_k and self.backend == "hf":
            raise ValueError("teacher_scoring.top_k is the top-k approximation of the vLLM "
                             "backends; teacher_scoring=hf computes every signal exactly "
                             "(leave top_k at 0)")
        self.check_engine_options("teacher_scoring")
        check_number("request_timeout", self.request_timeout, low=0.0, owner="teacher_scoring")
        check_int("max_concurrent_requests", self.max_concurrent_requests,
                  owner="teacher_scoring")
        if self.devices is not None:
            parts = [p.strip() for p in str(self.devices).split(",")]
            if not all(p.isdigit() for p in parts):
                raise ValueError("teacher_scoring.devices must list GPU indices like '1' or "
                                 f"'2,3', got {self.devices!r}")
            if self.in_process:
                raise ValueError("teacher_scoring.devices gives the teacher engine its own GPUs, "
                                 "which needs its engine core in its own process "
                                 "(teacher_scoring.in_process=false)")
        urls = list(self.urls or [])
        for url in urls:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"teacher_scoring.urls: {url!r} is not an http(s) URL")
        if len({u.rstrip("/") for u in urls}) != len(urls):
            raise ValueError(f"teacher_scoring.urls lists a server more than once: {urls}")
        if self.backend == "vllm_server" and not urls:
            raise ValueError("teacher_scoring=vllm_server needs the teacher servers' URLs: "
                             "teacher_scoring.urls=[http://host:port,...] (start each with "
                             "saopd-serve --model <teacher>)")
        # options of another backend must keep their defaults
        own = set(BACKEND_OPTIONS[self.backend]) | {"backend", "top_k"}
        changed = []
        for f in fields(self):
            if f.name in own:
                continue
            default = f.default_factory() if callable(f.default_factory) else f.default
            if getattr(self, f.name) != default:
                changed.append(f.name)
        if changed:
            users = {name: [b for b, opts in BACKEND_OPTIONS.items() if name in opts]
                     for name in changed}
            raise ValueError(
                f"teacher_scoring={self.backend} does not use "
                + ", ".join(f"teacher_scoring.{n} (an option of {' / '.join(users[n])})"
                            for n in changed))
