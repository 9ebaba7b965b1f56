"""A rollout engine that samples from the live student module with HF ``generate``.

:class:`HFGenerateEngine` renders each chat with the tokenizer's chat template, left-pads a batch
of prompts (each repeated ``n`` times), samples with ``model.generate`` and returns the responses
with the sampler's log-probs. It holds no copy of the weights: it samples from the very module
being trained, so there is nothing to synchronise after an optimizer step.

Sampling is exactly :class:`~saopd.rollout.base.SamplingParams`: temperature, nucleus ``top_p``
and nothing else. The model's own ``generation_config`` (e.g. Qwen's ``top_k=20``,
``repetition_penalty=1.05``, HF's global default ``top_k=50``) is ignored for the duration of the
call, so the sampled distribution is ``softmax(logits / T)`` restricted to the top-p nucleus, the
same as vLLM's.

Sampler log-probs are ``log_softmax`` of the *raw* logits (untempered, before any
top-p/temperature processing) at the sampled token, i.e. what ``output_logits=True`` returns,
not ``output_scores`` (processed). They are recorded on the fly by a logits processor
(:class:`saopd.rollout.hf_decode.RawLogprobRecorder`) that runs
before HF's temperature/top-p warpers, so memory is ``O(rows x vocabulary)`` instead of the
``O(rows x max_new_tokens x vocabulary)`` of keeping every step's logits (for Qwen's 151,936-token
vocabulary, 64 rows x 1,024 steps would be 40 GB). The tests check them against
``output_logits`` and against a teacher-forced forward pass of the same model.

Responses are cut after their first stop token (kept): the engine contract's stop-token policy
(:func:`~saopd.rollout.base.default_stop_token_ids`), unless ``eos_token_ids`` is given. A
response that stops at once is ``[eos]`` (length 1, ``finished=True``); a response of length 0
cannot occur, since ``max_new_tokens >= 1`` and at least one token is always sampled.

Vision-language models (``processor=``, a Qwen-VL processor from :mod:`saopd.models.vlm`): chats
may hold image parts; each prompt is prepared by :func:`saopd.prompts.vision.encode_prompt` (the
processor's chat template, every ``<|image_pad|>`` expanded to its image's token count), and
``generate`` receives ``pixel_values`` ``[P, D]``, ``image_grid_thw`` ``[N, 3]`` and
``mm_token_type_ids`` ``[rows, width]`` (the images of every row, row after row, repeated for the
``n`` samples of a prompt), from which the model computes its 3D M-RoPE positions. Rollouts carry
the expanded prompt ids. Left truncation never cuts an image (``ValueError``). Responses never
hold the vision special tokens (suppressed after the raw log-probs are recorded). Without a
processor, behaviour is that of a text-only LM, unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from saopd.choices import LONG_PROMPT_MODES
from saopd.config.rollout import HFRolloutConfig
from saopd.data_parallel import world_size
from saopd.models.sharding import is_fsdp2
from saopd.models.vlm import check_engine_processor, vision_special_ids, vision_token_ids
from saopd.prompts.render import render_prompt_ids
from saopd.prompts.vision import encode_prompt
from saopd.rollout.base import (
    Message,
    Rollout,
    RolloutBatch,
    SamplingParams,
    default_stop_token_ids,
    limit_prompts,
    refuse_images,
    token_id_list,
)
from saopd.rollout.hf_decode import (
    LEAN_DECODE_MODEL_TYPES,
    RawLogprobRecorder,
    eval_mode,
    lean_decode,
    seeded_rng,
)
from saopd.rollout.registry import ENGINES, EngineSetup
from saopd.rollout.sampling import SAMPLERS
from saopd.validation import check_choice

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "STATIC_CACHE_ROUND",
    "HFGenerateEngine",
]

#: The static KV cache's length is rounded up to a multiple of this many tokens
#: (``HFGenerateEngine(static_cache=True)``).
STATIC_CACHE_ROUND = 256

def _check_optional_int(name: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"HFGenerateEngine.{name} must be None or an int >= 1, got {value!r}")
    return value


def _sharded_across_ranks(model: torch.nn.Module) -> bool:
    """True for an FSDP2-sharded model in a multi-rank process group."""
    return world_size() > 1 and is_fsdp2(model)


@ENGINES.register("hf")
class HFGenerateEngine:
    """Samples rollouts from a live HF causal LM (the student being trained).

    Args:
        model: a ``transformers`` causal LM (anything with ``generate``), on CPU or GPU (inputs
            go to the device of its first parameter).
        tokenizer: its tokenizer, with a chat template.
        batch_size: prompts per ``model.generate`` call (each repeated ``n`` times, so
            ``batch_size * n`` rows); None = all prompts in one call.
        max_prompt_length: limit on rendered prompt tokens; None = no limit.
        prompt_truncation: what to do with a longer prompt: ``"truncate"`` keeps its last
            ``max_prompt_length`` tokens, ``"error"`` raises ``ValueError`` naming the prompt,
            ``"skip"`` samples nothing for it. Counts go to ``RolloutBatch.num_truncated_prompts``
            / ``num_skipped_prompts``.
        greedy: argmax decoding instead of sampling (for tests and evaluation; temperature and
            top_p are then ignored, sampler log-probs are still the raw ones).
        chat_template_kwargs: extra variables for the chat template (e.g.
            ``{"enable_thinking": False}`` for Qwen3).
        eos_token_ids: stop tokens; None = :func:`default_stop_token_ids`.
        processor: a Qwen-VL processor (:func:`saopd.models.vlm.load_vlm_processor`) for a
            vision-language student: chats may then hold image parts (module docstring). Its
            tokenizer must be ``tokenizer``.
        lean_decode: sample text prompts of the model families in
            :data:`~saopd.rollout.hf_decode.LEAN_DECODE_MODEL_TYPES` with
            :func:`~saopd.rollout.hf_decode.lean_decode` (the same tokens and
            log-probs as ``model.generate``, several times less overhead per token); False =
            always ``model.generate``.
        sampler: ``multinomial`` (``generate``'s draw) or ``inverse_cdf`` (lean loop only:
            :mod:`saopd.rollout.sampling`); a student that needs ``model.generate`` (a
            vision-language model, another family, ``lean_decode=False``) refuses
            ``inverse_cdf`` at its first call.
        static_cache: sample with ``model.generate`` over transformers' static KV cache
            (``cache_implementation="static"``, sized up to a multiple of
            :data:`STATIC_CACHE_ROUND` tokens so that steps reuse one shape) with its decode
            step compiled by ``torch.compile`` (``mode="reduce-overhead"``: CUDA graphs, on a
            GPU); the lean loop is then not used. Tokens and raw log-probs as ``generate``'s.
        compile_backend: ``torch.compile``'s backend for the static-cache decode step
            (``"inductor"``; ``"eager"`` traces without generating code, for tests); None =
            the static cache without compiling. Compiled on the CPU too.

    Generation runs under ``torch.no_grad()`` with the model in eval mode; each submodule's
    train/eval mode is restored afterwards. With ``SamplingParams.seed`` set, the CPU RNG and the
    model device's RNG are seeded for the call and restored afterwards, so the training RNG
    stream is not perturbed; results are then reproducible for the same prompts, ``batch_size``,
    model and device. With ``seed=None`` the global RNG is used (and advanced).

    The rollouts of a skipped prompt are absent: ``RolloutBatch.messages`` still lists every
    prompt and ``Rollout.prompt_index`` indexes it.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        batch_size: int | None = HFRolloutConfig.batch_size,
        max_prompt_length: int | None = None,
        prompt_truncation: str = "truncate",
        greedy: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        eos_token_ids: Sequence[int] | None = None,
        processor: Any | None = None,
        lean_decode: bool = True,
        sampler: str = "multinomial",
        static_cache: bool = HFRolloutConfig.static_cache,
        compile_backend: str | None = "inductor",
    ) -> None:
        if not callable(getattr(model, "generate", None)):
            raise TypeError(f"model must have a generate method, got {type(model).__name__}")
        check_choice("prompt_truncation", prompt_truncation, LONG_PROMPT_MODES,
                     owner="HFGenerateEngine")
        if not isinstance(greedy, bool):
            raise ValueError(f"HFGenerateEngine.greedy must be a bool, got {greedy!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = _check_optional_int("batch_size", batch_size)
        self.max_prompt_length = _check_optional_int("max_prompt_length", max_prompt_length)
        self.prompt_truncation = prompt_truncation
        self.greedy = greedy
        self.lean_decode = bool(lean_decode)
        check_choice("sampler", sampler, SAMPLERS, owner="HFGenerateEngine")
        self.sampler = sampler
        self.static_cache = bool(static_cache)
        if self.static_cache and sampler != "multinomial":
            raise ValueError("HFGenerateEngine.static_cache samples through model.generate, "
                             "which draws with multinomial only")
        self.compile_backend = compile_backend
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        if eos_token_ids is not None:
            stop = tuple(dict.fromkeys(token_id_list(eos_token_ids)))
            if not stop:
                raise ValueError("HFGenerateEngine.eos_token_ids must list at least one id")
        else:
            stop = default_stop_token_ids(tokenizer, model)
        self.stop_token_ids: tuple[int, ...] = stop
        pad = tokenizer.pad_token_id
        self.pad_token_id: int = int(pad) if pad is not None else stop[0]
        self.last_load_copied = 0  # tensors copied by the last load_weights call
        self.processor: Any | None = None
        self._vision_ids: frozenset[int] = frozenset()  # the processor's vision special tokens
        if processor is not None:
            self.set_processor(processor)

    @classmethod
    def from_config(cls, conf: HFRolloutConfig, student: PreTrainedModel,
                    tokenizer: PreTrainedTokenizerBase, setup: EngineSetup) -> HFGenerateEngine:
        """The engine ``rollout=hf`` builds (:func:`saopd.rollout.registry.build_engine`)."""
        return cls(student, tokenizer, batch_size=conf.batch_size, greedy=conf.greedy,
                   sampler=conf.sampler, static_cache=conf.static_cache,
                   max_prompt_length=setup.max_prompt_length,
                   prompt_truncation=setup.prompt_truncation,
                   chat_template_kwargs=setup.chat_template_kwargs, processor=setup.processor)

    def set_processor(self, processor: Any,
                      chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        """Sample from chats with images through ``processor`` (a Qwen-VL processor whose
        tokenizer is the engine's); ``chat_template_kwargs`` replace the engine's when given."""
        check_engine_processor(processor, self.tokenizer, "HFGenerateEngine")
        self.processor = processor
        self._vision_ids = vision_special_ids(processor)
        if chat_template_kwargs is not None:
            self.chat_template_kwargs = dict(chat_template_kwargs)

    @property
    def device(self) -> torch.device:
        """The device of the model's first parameter (CPU for a model without parameters)."""
        param = next(self.model.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The chat prompt rendered with the generation prompt, before any truncation (with a
        processor: its image placeholders expanded)."""
        if self.processor is not None:
            return self._encode(messages).ids
        return render_prompt_ids(
            self.tokenizer,
            messages,
            add_generation_prompt=True,
            chat_template_kwargs=self.chat_template_kwargs,
        )

    # ------------------------------------------------------------------------------------------
    # generate

    def _encode(self, messages: Sequence[Message]) -> Any:
        return encode_prompt(self.processor, messages,
                             chat_template_kwargs=self.chat_template_kwargs)

    def _prepare_prompts(
        self, messages: Sequence[Sequence[Message]]
    ) -> tuple[list[tuple[int, list[int], Any]], int, int]:
        """(prompt index, ids, vision prompt or None) of the prompts to sample, and the
        truncated/skipped counts."""
        if self.processor is None:
            refuse_images(messages)
        visions = [self._encode(chat) if self.processor is not None else None
                   for chat in messages]
        ids = [list(v.ids) if v is not None else self.prompt_ids(chat)
               for v, chat in zip(visions, messages, strict=True)]
        limited, truncated, skipped = limit_prompts(ids, self.max_prompt_length,
                                                    self.prompt_truncation,
                                                    protected=self._vision_ids)
        kept = [(i, kept_ids, visions[i]) for i, kept_ids in limited]
        return kept, truncated, skipped

    def _suppress(self, device: torch.device) -> list[Any]:
        """With a processor: a logits processor that forbids the vision special tokens (image /
        video pads, vision start / end) in responses, where they have no meaning and would
        break the contexts' image placement. It runs after the raw log-prob recorder, so the
        recorded log-probs stay those of the raw distribution."""
        if self.processor is None:
            return []
        from transformers import SuppressTokensLogitsProcessor

        return [SuppressTokensLogitsProcessor(sorted(self._vision_ids), device=device)]

    def _generation_config(self, sampling: SamplingParams, length: int = 0) -> Any:
        """``generate``'s settings; ``length``: prompt width + new tokens (the static cache's
        minimum size)."""
        from transformers import GenerationConfig

        kwargs: dict[str, Any] = {
            "max_new_tokens": sampling.max_new_tokens,
            "num_beams": 1,
            "num_return_sequences": 1,
            "eos_token_id": list(self.stop_token_ids),
            "pad_token_id": self.pad_token_id,
            "return_dict_in_generate": True,
            "use_cache": True,
        }
        bos = self.tokenizer.bos_token_id
        if bos is not None:
            kwargs["bos_token_id"] = bos
        if self.greedy:
            kwargs.update(do_sample=False)
        else:
            # top_k=0 switches off HF's global default top_k=50
            kwargs.update(
                do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0
            )
        if self.static_cache:
            kwargs.update(cache_implementation="static", **self._compile_kwargs(length))
        return GenerationConfig(**kwargs)

    def _compile_kwargs(self, length: int) -> dict[str, Any]:
        """The static cache's size (``length`` = prompt width + ``max_new_tokens``, rounded up to
        :data:`STATIC_CACHE_ROUND`: later calls with other widths reuse the cache's shape, and
        the compiled step) and the decode step's compile settings."""
        from transformers import CompileConfig

        out: dict[str, Any] = {"max_cache_len": -(-length // STATIC_CACHE_ROUND) *
                               STATIC_CACHE_ROUND}
        if self.compile_backend is None:
            out["disable_compile"] = True
            return out
        on_gpu = self.device.type == "cuda"
        compile_config = CompileConfig(backend=self.compile_backend, fullgraph=False,
                                       mode="reduce-overhead" if on_gpu else None)
        # transformers compiles on CUDA-like devices only unless this flag is set (its own
        # documented switch "to compile on e.g. CPU"): the CPU tests run the compiled path
        compile_config._compile_all_devices = True
        out["compile_config"] = compile_config
        return out

    def _vision_kwargs(self, visions: Sequence[Any], input_ids: torch.Tensor,
                       device: torch.device) -> dict[str, torch.Tensor]:
        """``pixel_values`` [P, D], ``image_grid_thw`` [N, 3] (rows' images in row order) and
        ``mm_token_type_ids`` [rows, width] for ``generate``; empty when no row has images."""
        with_images = [v for v in visions if v is not None and v.num_images]
        if not with_images:
            return {}

        ids = vision_token_ids(self.processor)
        types = torch.zeros_like(input_ids)
        types[input_ids == ids["image"]] = 1
        return {
            "pixel_values": torch.cat([v.pixel_values for v in with_images]).to(device),
            "image_grid_thw": torch.cat([v.image_grid_thw for v in with_images]).to(device),
            "mm_token_type_ids": types.to(device),
        }

    def _left_padded(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` left-padded: input ids and attention mask ``[R, W]`` (CPU, int64)."""
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, ids in enumerate(rows):
            input_ids[j, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[j, width - len(ids) :] = 1
        return input_ids, attention_mask

    def uses_lean_decode(self) -> bool:
        """Whether :meth:`generate` samples text prompts with
        :func:`~saopd.rollout.hf_decode.lean_decode` instead of
        ``model.generate`` (``lean_decode`` set, a model family the tests check it on
        (:data:`LEAN_DECODE_MODEL_TYPES`), no processor, not FSDP-sharded across ranks)."""
        if not self.lean_decode or self.static_cache or self.processor is not None:
            return False
        config = getattr(self.model, "config", None)
        if getattr(config, "model_type", None) not in LEAN_DECODE_MODEL_TYPES or getattr(
                config, "is_encoder_decoder", False):
            return False
        return not _sharded_across_ranks(self.model)

    def _generate_rows(
        self, rows: list[list[int]], sampling: SamplingParams, device: torch.device,
        visions: Sequence[Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-pad ``rows``, generate; ``[R, T]`` new tokens and their raw log-probs (CPU).

        ``visions[j]``: row j's :class:`~saopd.prompts.vision.VisionPrompt` (or None)."""
        from transformers import LogitsProcessorList

        input_ids, attention_mask = self._left_padded(rows)
        width = input_ids.shape[1]
        if self.uses_lean_decode() and not any(v is not None for v in visions or []):
            tokens, logprobs = lean_decode(
                self.model, input_ids.to(device), attention_mask.to(device),
                max_new_tokens=sampling.max_new_tokens, stop_token_ids=self.stop_token_ids,
                pad_token_id=self.pad_token_id,
                temperature=None if self.greedy else sampling.temperature,
                top_p=sampling.top_p, sampler=self.sampler)
            return tokens.cpu(), logprobs.float().cpu()
        if self.sampler != "multinomial" and not self.greedy:
            raise ValueError(
                f"rollout.sampler={self.sampler!r} needs the lean decode loop, which this "
                f"student does not use (model_type "
                f"{getattr(getattr(self.model, 'config', None), 'model_type', None)!r}, "
                f"vision inputs or a sharded model): model.generate samples with multinomial "
                f"only; set rollout.sampler=multinomial")
        config = self._generation_config(sampling, width + sampling.max_new_tokens)
        extra = self._vision_kwargs(visions or [], input_ids, device)
        recorder = RawLogprobRecorder()
        model = self.model
        saved_config = getattr(model, "generation_config", None)
        # generate() fills unset fields from model.generation_config: hide it for the call
        model.generation_config = config
        try:
            out = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=config,
                logits_processor=LogitsProcessorList([recorder, *self._suppress(device)]),
                **extra,
                # a sharded (FSDP2) student gathers weights collectively at every forward: keep
                # all ranks generating until the last one is done, or they deadlock
                synced_gpus=_sharded_across_ranks(model),
            )
        finally:
            model.generation_config = saved_config
        sequences = out.sequences
        logprobs = recorder.finish(sequences, width)
        return sequences[:, width:].cpu(), logprobs.float().cpu()

    def _to_rollouts(
        self, prompt_index: Sequence[int], prompts: Sequence[list[int]], tokens: torch.Tensor,
        logprobs: torch.Tensor,
    ) -> list[Rollout]:
        stop = torch.tensor(self.stop_token_ids, dtype=tokens.dtype)
        is_stop = torch.isin(tokens, stop)
        has_stop = is_stop.any(dim=1)
        first = torch.where(has_stop, is_stop.int().argmax(dim=1) + 1, tokens.shape[1])
        out = []
        for j, p in enumerate(prompt_index):
            n = int(first[j])
            out.append(
                Rollout(
                    prompt_index=p,
                    response_ids=tokens[j, :n].tolist(),
                    sampler_logprobs=logprobs[j, :n].tolist(),
                    finished=bool(has_stop[j]),
                    prompt_ids=list(prompts[j]),
                )
            )
        return out

    def generate(
        self, messages: Sequence[list[Message]], sampling: SamplingParams
    ) -> RolloutBatch:
        """Sample ``sampling.n`` responses for each chat prompt.

        Rollouts come grouped by prompt, in prompt order (``n`` consecutive rows per kept
        prompt). Each response has 1 to ``max_new_tokens`` tokens; ``finished`` responses end
        with their first stop token, the others have exactly ``max_new_tokens`` tokens.
        """
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if isinstance(messages, (str, Mapping)):
            raise TypeError("messages must be a sequence of chats (lists of message dicts)")
        chats = [list(chat) for chat in messages]
        kept, truncated, skipped = self._prepare_prompts(chats)
        batch = RolloutBatch(
            messages=chats, num_truncated_prompts=truncated, num_skipped_prompts=skipped
        )
        if not kept:
            return batch
        chunk = self.batch_size or len(kept)
        device = self.device
        with seeded_rng(sampling.seed, device), eval_mode(self.model), torch.no_grad():
            for start in range(0, len(kept), chunk):
                part = kept[start : start + chunk]
                index = [i for i, _, _ in part for _ in range(sampling.n)]
                rows = [ids for _, ids, _ in part for _ in range(sampling.n)]
                visions = [v for _, _, v in part for _ in range(sampling.n)]
                tokens, logprobs = self._generate_rows(rows, sampling, device, visions)
                batch.rollouts.extend(self._to_rollouts(index, rows, tokens, logprobs))
        return batch

    # ------------------------------------------------------------------------------------------
    # weights

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Check these weights against the engine's model and copy in those that differ.

        Names are the model's ``named_parameters()`` / ``named_buffers()`` names (tied weights
        under each of their names); a subset is fine. Every name and shape is checked before
        anything is copied (``ValueError`` listing unknown names / shape mismatches). A tensor
        that *is* the model's own parameter (same storage), as when training updates the very
        module the engine samples from, is not copied: for the live student this call is a
        validated no-op. Other tensors (e.g. weights of a separate trained copy) are copied in
        place (converted to the parameter's dtype/device). ``last_load_copied`` tells how many
        were copied.
        """
        own: dict[str, torch.Tensor] = dict(self.model.named_parameters(remove_duplicate=False))
        own.update(dict(self.model.named_buffers(remove_duplicate=False)))
        items = list(named_tensors)
        unknown = [name for name, _ in items if name not in own]
        if unknown:
            raise ValueError(
                f"load_weights got {len(unknown)} names that are not parameters or buffers of "
                f"{type(self.model).__name__}: {unknown[:5]}"
            )
        bad = [
            f"{name}: {tuple(t.shape)} vs the model's {tuple(own[name].shape)}"
            for name, t in items
            if tuple(t.shape) != tuple(own[name].shape)
        ]
        if bad:
            raise ValueError(f"load_weights got tensors of the wrong shape: {bad[:5]}")
        copied = 0
        with torch.no_grad():
            for name, tensor in items:
                target = own[name]
                same = (
                    tensor.device == target.device
                    and tensor.dtype == target.dtype
                    and tensor.data_ptr() == target.data_ptr()
                    and tensor.stride() == target.stride()
                )
                if not same:
                    target.copy_(tensor)
                    copied += 1
        self.last_load_copied = copied
