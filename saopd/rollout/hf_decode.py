"""How the HF rollout engine decodes: the raw log-prob recorder, the lean decode loop, and the
RNG and train/eval-mode scopes of a call (:class:`saopd.rollout.hf.HFGenerateEngine` uses them).

- :class:`RawLogprobRecorder`: a logits processor, first in ``model.generate``'s list, that
  records ``log_softmax`` of the *raw* logits (before temperature / top-p) at each sampled token,
  one ``[rows, V]`` block at a time (``O(rows x V)`` memory, not ``O(rows x T x V)``).
- :func:`lean_decode`: the same forwards, probabilities and RNG calls as
  ``model.generate(do_sample=..., top_k=0, use_cache=True)`` for the model families in
  :data:`LEAN_DECODE_MODEL_TYPES`, without ``generate``'s per-token machinery; its tokens are
  drawn by :func:`saopd.rollout.sampling.sample_tokens`.
- :func:`seeded_rng` / :func:`eval_mode`: scopes that seed (then restore) the CPU and device RNGs
  and put a module in eval mode (then restore every submodule's mode).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from saopd.rollout.sampling import sample_tokens

__all__ = [
    "LEAN_DECODE_MODEL_TYPES",
    "RawLogprobRecorder",
    "eval_mode",
    "lean_decode",
    "seeded_rng",
]


class RawLogprobRecorder:
    """A logits processor (first in HF's list) that records ``log_softmax(raw logits)`` of the
    sampled tokens and passes the logits on unchanged.

    At step ``t`` it receives the raw logits of step ``t`` and ``input_ids`` ending with the
    token sampled at step ``t - 1``; it gathers that token's log-prob from the previous step's
    distribution. The last token's is gathered in :meth:`finish`.
    """

    def __init__(self) -> None:
        self.prev: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prev is not None:
            self.steps.append(self.prev.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.prev = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """``[rows, T]`` log-probs of ``sequences[:, prompt_len:]`` (``T`` generated tokens)."""
        num_new = sequences.shape[1] - prompt_len
        steps = self.steps[:num_new]  # generate may run (and undo) steps past the stop
        if len(steps) == num_new - 1:
            assert self.prev is not None
            steps.append(self.prev.gather(-1, sequences[:, -1:]).squeeze(-1))
        if len(steps) != num_new:
            raise RuntimeError(
                f"recorded {len(steps)} sampler log-probs for {num_new} generated tokens "
                "(was the logits processor skipped?)"
            )
        self.prev = None
        return torch.stack(steps, dim=1)


@contextlib.contextmanager
def seeded_rng(seed: int | None, device: torch.device) -> Iterator[None]:
    """Seed the CPU RNG and ``device``'s RNG for the block, then restore both states."""
    if seed is None:
        yield
        return
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
    elif device.type == "cuda":
        # fork_rng restores only the listed device: seed only that one (torch.manual_seed would
        # re-seed every GPU of the process)
        with torch.random.fork_rng(devices=[device]):
            torch.random.default_generator.manual_seed(seed)
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
            yield
    else:
        with torch.random.fork_rng(devices=[device], device_type=device.type):
            torch.manual_seed(seed)
            yield


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode for the block; afterwards every submodule gets its own previous mode back."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training



# Model families whose forward :func:`lean_decode` is tested to drive exactly as ``generate`` does
# (tests/rollout/test_hf.py); others sample through ``model.generate``.
LEAN_DECODE_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3"})


def _warpers(temperature: float | None, top_p: float) -> list[Any]:
    """HF's own sampling warpers, as ``generate`` builds them for ``do_sample=True, top_k=0``:
    temperature (when not 1), then top-p (when below 1); none for greedy (``temperature``
    None)."""
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    if temperature is None:
        return []
    out: list[Any] = []
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return out


def lean_decode(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                *, max_new_tokens: int, stop_token_ids: Sequence[int], pad_token_id: int,
                temperature: float | None, top_p: float = 1.0, sampler: str = "multinomial"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``[R, T]`` new tokens and their raw log-probs, as ``model.generate`` does.

    The same computation as ``generate(do_sample=..., temperature, top_p, top_k=0,
    use_cache=True)`` (transformers 5.x), without its per-token machinery: one prefill of the
    left-padded ``input_ids`` / ``attention_mask`` ``[R, W]`` with position ids
    ``cumsum(mask) - 1`` (0 at pads), then one forward per token over the KV cache
    (``logits_to_keep=1``), the raw float32 logits of the last position warped by HF's own
    temperature / top-p warpers, ``softmax`` and ``torch.multinomial(probs, 1)`` (``argmax`` of
    the raw logits when ``temperature`` is None: greedy). A row that has sampled a stop token
    gets ``pad_token_id`` afterwards; decoding ends when every row has stopped or after
    ``max_new_tokens`` steps. As in ``generate``, an all-ones mask is not passed to the model.
    So the forwards, the probabilities and the RNG calls are those of ``generate``, in the same
    order: for a fixed seed the tokens are the same (the tests check it). ``sampler="inverse_cdf"``
    draws from the same probabilities by inverse CDF instead (:mod:`saopd.rollout.sampling`:
    another random stream, other tokens for a seed).

    Log-probs are ``log_softmax`` of the raw logits at each emitted token (pads included), as
    the engine's recorder takes them. Returns ``(tokens [R, T] int64, logprobs [R, T]
    float32)`` on the model's device, ``1 <= T <= max_new_tokens``. Call it under
    ``torch.no_grad()`` with the model in eval mode.
    """
    rows = input_ids.shape[0]
    device = input_ids.device
    warpers = _warpers(temperature, top_p)
    stop = torch.tensor(list(stop_token_ids), dtype=torch.long, device=device)
    position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    mask: torch.Tensor | None = None if bool((attention_mask == 1).all()) else attention_mask
    unfinished = torch.ones(rows, dtype=torch.long, device=device)
    tokens: list[torch.Tensor] = []
    logprobs: list[torch.Tensor] = []
    ids, cache = input_ids, None
    for _ in range(max_new_tokens):
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids,
                    past_key_values=cache, use_cache=True, logits_to_keep=1, return_dict=True)
        cache = out.past_key_values
        logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)  # [R, V]
        if temperature is None:
            nxt = torch.argmax(logits, dim=-1)
        else:
            scores = logits
            for warp in warpers:
                scores = warp(ids, scores)
            probs = torch.nn.functional.softmax(scores, dim=-1)
            nxt = sample_tokens(probs, sampler)
        nxt = nxt * unfinished + pad_token_id * (1 - unfinished)  # [R]
        tokens.append(nxt)
        logprobs.append(torch.log_softmax(logits, dim=-1).gather(-1, nxt[:, None]).squeeze(-1))
        unfinished = unfinished & ~torch.isin(nxt, stop)
        if int(unfinished.max()) == 0:
            break
        ids = nxt[:, None]
        position_ids = position_ids[:, -1:] + 1
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones((rows, 1))], dim=-1)
    return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1)
