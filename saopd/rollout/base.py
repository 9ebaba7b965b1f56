"""The rollout-engine protocol: sample responses from the current student.

An engine turns a batch of chat prompts into sampled responses (token ids, plus the sampler's
log-probs of the sampled tokens when it can report them). Training calls ``generate`` once per
step from a Lightning callback, and ``load_weights`` after each optimizer step for engines that
hold their own copy of the weights (vLLM); engines that sample from the live student module (HF
``generate``) need no sync.

The stop-token policy every engine follows is here too (:func:`default_stop_token_ids`):
responses are cut after their first stop token (kept). Stop tokens: the tokenizer's EOS, the
chat template's end-of-turn token when it differs (:data:`END_OF_TURN_TOKENS`: those of them that
are in the vocabulary and appear in the template) and the model's
``generation_config.eos_token_id`` (Qwen lists ``<|im_end|>`` and ``<|endoftext|>``), unless the
engine is given its own.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from saopd.choices import LONG_PROMPT_MODES
from saopd.prompts.vision import has_images
from saopd.validation import check_choice, check_fraction, check_positive

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]

# Chat templates' end-of-turn tokens (ChatML/Qwen/SmolLM2, Llama 3, Gemma, Phi-3).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


def token_id_list(value: Any) -> list[int]:
    """Token ids as a list of ints: None -> ``[]``, one id -> ``[id]``, a tensor or any iterable
    of ids -> its ids in order (a generation config's ``eos_token_id`` takes every form)."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.flatten().tolist()]
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def default_stop_token_ids(
    tokenizer: PreTrainedTokenizerBase, model: torch.nn.Module | Any | None = None
) -> tuple[int, ...]:
    """EOS, the chat template's end-of-turn token and the model's generation-config EOS ids.

    ``model``: anything with a ``generation_config`` (a model, or what stands in for one); None
    = none. Order: tokenizer EOS first, duplicates removed. Raises ``ValueError`` when none is
    found.
    """
    ids: list[int] = token_id_list(tokenizer.eos_token_id)
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):  # a dict of named templates
        template = " ".join(str(t) for t in dict(template).values())
    vocab = tokenizer.get_vocab()
    ids += [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and t in template]
    gen_config = getattr(model, "generation_config", None)
    if gen_config is not None:
        ids += token_id_list(getattr(gen_config, "eos_token_id", None))
    out = tuple(dict.fromkeys(ids))
    if not out:
        raise ValueError(
            f"{type(tokenizer).__name__} has no eos token and its chat template no known "
            "end-of-turn token; pass eos_token_ids=[...]"
        )
    return out



@dataclass(frozen=True)
class SamplingParams:
    """How responses are sampled.

    Attributes:
        n: samples per prompt (>= 1).
        temperature: softmax temperature (> 0; the paper samples at 1.0).
        top_p: nucleus mass in (0, 1].
        max_new_tokens: response length limit (>= 1); longer responses are cut and marked
            unfinished.
        seed: base seed of the sampler (None = the global RNG).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an int >= 1, got {self.n!r}")
        check_positive("temperature", self.temperature, owner="SamplingParams")
        check_fraction("top_p", self.top_p, owner="SamplingParams")
        if self.top_p == 0:
            raise ValueError("SamplingParams.top_p must be in (0, 1], got 0")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}"
            )


@dataclass
class Rollout:
    """One sampled response.

    Attributes:
        prompt_index: index of its prompt in the batch of ``generate``.
        response_ids: sampled token ids, no padding; ends with the EOS token when ``finished``.
        sampler_logprobs: log-prob of each sampled token under the engine's *untempered*
            distribution (log softmax of the raw logits, vLLM's ``raw`` mode), aligned with
            ``response_ids``; None when the engine does not report them.
        finished: True if sampling stopped at an EOS token, False if cut at max_new_tokens.
        prompt_ids: the prompt token ids the engine conditioned on (after any truncation), so
            that scoring uses exactly the context the response was sampled from; None when
            the engine does not report them (contexts then re-render the chat template).
    """

    prompt_index: int
    response_ids: list[int]
    sampler_logprobs: list[float] | None = None
    finished: bool = True
    prompt_ids: list[int] | None = None


@dataclass
class RolloutBatch:
    """The rollouts of one ``generate`` call: ``n`` per kept prompt, grouped by prompt.

    ``messages`` are all the prompts given to ``generate`` and ``Rollout.prompt_index`` indexes
    them, so ``len(rollouts) == (len(messages) - num_skipped_prompts) * n``.

    Attributes:
        num_truncated_prompts: prompts longer than the engine's prompt limit that were cut (the
            first tokens dropped) before sampling.
        num_skipped_prompts: prompts longer than the limit that got no rollouts at all.
    """

    messages: list[list[Message]]
    rollouts: list[Rollout] = field(default_factory=list)
    num_truncated_prompts: int = 0
    num_skipped_prompts: int = 0

    def row_messages(self) -> list[list[Message]]:
        """The prompt of each rollout, aligned with ``rollouts``."""
        return [self.messages[r.prompt_index] for r in self.rollouts]

    def response_lengths(self) -> torch.Tensor:
        return torch.tensor([len(r.response_ids) for r in self.rollouts], dtype=torch.long)

    def sampler_logprobs(self, length: int) -> torch.Tensor | None:
        """[B, length] float32 right-padded sampler log-probs, or None if any is missing."""
        if not self.rollouts or any(r.sampler_logprobs is None for r in self.rollouts):
            return None
        out = torch.zeros(len(self.rollouts), length)
        for i, r in enumerate(self.rollouts):
            lp = r.sampler_logprobs or []
            out[i, : len(lp)] = torch.tensor(lp[:length])
        return out


def limit_prompts(
    prompt_ids: Sequence[Sequence[int]], max_prompt_length: int | None, mode: str,
    *, protected: Collection[int] = (),
) -> tuple[list[tuple[int, list[int]]], int, int]:
    """Apply a prompt-length limit the way every engine does.

    Args:
        prompt_ids: each prompt's rendered token ids, in batch order.
        max_prompt_length: the limit (None = no limit).
        mode: one of :data:`saopd.choices.LONG_PROMPT_MODES`: ``"truncate"`` keeps a longer
            prompt's last ``max_prompt_length`` tokens, ``"error"`` raises ``ValueError`` naming
            the prompt, ``"skip"`` drops it.
        protected: token ids that left truncation must not cut (a VLM's image and vision
            start/end tokens: an image cannot be cut in part); ``ValueError`` naming the prompt
            when the dropped part holds one.

    Returns:
        ``(kept, num_truncated, num_skipped)``: ``kept`` lists ``(prompt index, ids)`` of the
        prompts to sample, in order.
    """
    check_choice("prompt_truncation", mode, LONG_PROMPT_MODES)
    kept: list[tuple[int, list[int]]] = []
    truncated = skipped = 0
    for i, ids in enumerate(prompt_ids):
        ids = list(ids)
        if not ids:
            raise ValueError(f"prompt {i} renders to no tokens")
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            if mode == "error":
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens > max_prompt_length {max_prompt_length}; "
                    "pass prompt_truncation='truncate' or 'skip'"
                )
            if mode == "skip":
                skipped += 1
                continue
            if protected and not set(ids[: len(ids) - max_prompt_length]).isdisjoint(protected):
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens > max_prompt_length {max_prompt_length}, "
                    "and left truncation would cut into an image (image tokens cannot be "
                    "truncated); raise max_prompt_length or lower the images' max_pixels"
                )
            ids = ids[-max_prompt_length:]
            truncated += 1
        kept.append((i, ids))
    return kept, truncated, skipped


def check_context_fits(kept: Sequence[tuple[int, Sequence[int]]], max_new_tokens: int,
                       max_model_len: int, *, engine: str, fix: str) -> None:
    """``ValueError`` when the longest of ``kept`` (``limit_prompts``'s ``(index, ids)``) plus
    ``max_new_tokens`` exceeds the engine's ``max_model_len``, naming the prompt, the
    ``engine`` ("the vLLM engine's") and how to ``fix`` it."""
    if not kept:
        return
    index, ids = max(kept, key=lambda item: len(item[1]))
    if len(ids) + max_new_tokens > max_model_len:
        raise ValueError(f"prompt {index} has {len(ids)} tokens + max_new_tokens "
                         f"{max_new_tokens} > {engine} max_model_len {max_model_len}; {fix}")


def refuse_images(messages: Sequence[Sequence[Message]]) -> None:
    """For an engine without a processor: ``ValueError`` naming the first prompt that holds an
    image part."""
    bad = next((i for i, chat in enumerate(messages) if has_images(chat)), None)
    if bad is not None:
        raise ValueError(f"prompt {bad} holds images but the engine has no processor "
                         "(pass processor= for a vision-language model)")


@runtime_checkable
class RolloutEngine(Protocol):
    """What training needs from a sampler."""

    def generate(self, messages: Sequence[list[Message]], sampling: SamplingParams
                 ) -> RolloutBatch:
        """Sample ``sampling.n`` responses for each chat prompt."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Make the engine sample from these student weights from now on."""
        ...
