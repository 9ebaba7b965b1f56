"""A teacher with planted, known priors: the testbed for what SA-OPD filters.

:class:`PlantedPriorLM` wraps a causal LM and adds two known biases to its next-token logits z_t
(``[V]`` at position t of row b):

    z'_t = z_t + s + g * m_b * 1[t >= e_b]                                          (*)

- ``s`` ([V]): the **spurious, input-agnostic prior**, ``s_v = spurious_bonus`` for the chosen
  template tokens (``"So"``, ``" Therefore"``, ``" Let"``, ``" step"``, ...) and 0 elsewhere. It
  is the same in every context, so it survives prompt removal: it shifts A_full and A_res alike
  and adds (almost) nothing to the grounding gap |A_full - A_res| (paper Eq. 14). These are the
  tokens SA-OPD is meant to filter.
- ``g * m_b``: the **grounded bias**, ``g = grounded_bonus`` on every token that occurs in row b's
  prompt (``m_b`` in {0, 1}^V: the tokens of the row's first user turn, minus special tokens,
  whitespace-only tokens and the spurious set, so the two biases never stack), at the positions
  t >= e_b from the end of that turn on (a position sees the whole prompt only from there; the
  bias is causal). The residual context has an empty user turn (or none), so ``m_b = 0`` there:
  the bias vanishes with the prompt and adds about ``g`` to the grounding gap. SA-OPD should keep
  these tokens.

The user turn is found in the ids themselves: a ``turn_start`` token (``<|im_start|>``) followed
by the role ids (``user``), up to the next ``turn_end`` token (``<|im_end|>``); padding
(``attention_mask == 0``) never matches. A row without a user turn gets no grounded bias.

Scoring: saopd's chunked scoring reads backbone hidden states and the LM-head weight instead of
calling ``forward`` (:func:`saopd.scoring.passes.response_source`), so the wrapper provides
``response_logit_source``, which that function defers to. It returns an
:class:`~saopd.signals.LMHead` whose bias is ``b_head + s`` and whose hidden states and weight
carry the per-row bias exactly, as B extra dimensions::

    hidden' [B, R, H + B] = [hidden | g * onehot(b) * 1[t >= e_b]]
    weight' [V, H + B]    = [weight | m_1 ... m_B]          ->  hidden' @ weight'.T = (*)

so every consumer of an LMHead (log-probs, entropies, the exact KL, micro-batch row slicing of
the hidden states) sees the biased logits without any [B, T, V] tensor. The extra matmul columns
cost B / H of the head (under 2% for B = 8, H = 576).

``forward`` returns the base model's output with (*) added to ``.logits``; it needs the whole
context in ``input_ids`` (no KV cache) when the grounded bias is on. Training uses the wrapper as
the frozen teacher only; it has no ``generate``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from saopd.config.model import PlantedConfig
from saopd.models.factory import MODEL_WRAPPERS
from saopd.scoring.passes import response_source
from saopd.signals import LMHead, Logits, LogitSource
from saopd.validation import check_positive

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from saopd.contexts.batch import ContextBatch

__all__ = [
    "PlantedPriorLM",
    "plant_priors",
    "single_token_ids",
]

def single_token_ids(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[int]:
    """The token id of each text; ``ValueError`` naming every text that is not one token."""
    ids, bad = [], []
    for text in texts:
        enc = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(enc) == 1:
            ids.append(int(enc[0]))
        else:
            bad.append(f"{text!r} -> {enc}")
    if bad:
        raise ValueError("planted tokens must each be a single token of the tokenizer: "
                         + "; ".join(bad))
    return list(dict.fromkeys(ids))


def _excluded_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Special tokens and tokens that decode to whitespace only (never a grounded token)."""
    out = set(int(i) for i in tokenizer.all_special_ids)
    for token, idx in tokenizer.get_vocab().items():
        if token in tokenizer.all_special_tokens:
            continue
        if not tokenizer.convert_tokens_to_string([token]).strip():
            out.add(int(idx))
    return sorted(out)


class PlantedPriorLM(nn.Module):
    """A causal LM whose logits carry a known spurious prior and a known grounded bias (*).

    Args:
        base: the wrapped HF causal LM (kept as ``self.base``; frozen by the caller).
        spurious_ids: token ids of the input-agnostic prior.
        spurious_bonus, grounded_bonus: the bonuses s and g of (*) in nats.
        turn_start_id, turn_end_id: ids opening and closing a chat turn.
        user_role_ids: ids of the role that follows ``turn_start_id`` in a user turn.
        grounded_excluded_ids: ids never given the grounded bias (special, whitespace-only); the
            spurious ids are always excluded too.

    Attributes ``config``, ``get_output_embeddings`` and ``get_input_embeddings`` are the base's,
    so vocabulary checks and head-width slicing treat the wrapper like the model it wraps.
    """

    def __init__(self, base: nn.Module, *, spurious_ids: Sequence[int], spurious_bonus: float,
                 grounded_bonus: float, turn_start_id: int, user_role_ids: Sequence[int],
                 turn_end_id: int, grounded_excluded_ids: Sequence[int] = ()) -> None:
        super().__init__()
        head = base.get_output_embeddings()
        if head is None or getattr(head, "weight", None) is None:
            raise ValueError(f"{type(base).__name__} has no output embedding with a weight")
        vocab = int(head.weight.shape[0])
        for name, ids in (("spurious_ids", spurious_ids), ("user_role_ids", user_role_ids),
                          ("grounded_excluded_ids", grounded_excluded_ids),
                          ("turn ids", [turn_start_id, turn_end_id])):
            bad = [int(i) for i in ids if not 0 <= int(i) < vocab]
            if bad:
                raise ValueError(f"{name} has ids outside [0, {vocab}): {bad[:5]}")
        if not user_role_ids:
            raise ValueError("user_role_ids must not be empty")
        check_positive("spurious_bonus", spurious_bonus, allow_zero=True)
        check_positive("grounded_bonus", grounded_bonus, allow_zero=True)
        self.base = base
        self.config = base.config
        self.spurious_bonus = float(spurious_bonus)
        self.grounded_bonus = float(grounded_bonus)
        self.turn_start_id = int(turn_start_id)
        self.turn_end_id = int(turn_end_id)
        self.user_role_ids = [int(i) for i in user_role_ids]
        dtype = head.weight.dtype
        spurious = torch.zeros(vocab, dtype=dtype, device=head.weight.device)
        spurious[torch.as_tensor(list(spurious_ids), dtype=torch.long)] = self.spurious_bonus
        self.register_buffer("spurious_bias", spurious, persistent=False)  # s, [V]
        spurious_mask = torch.zeros(vocab, dtype=torch.bool, device=head.weight.device)
        spurious_mask[torch.as_tensor(list(spurious_ids), dtype=torch.long)] = True
        self.register_buffer("spurious_mask", spurious_mask, persistent=False)  # [V]
        allowed = ~spurious_mask.clone()
        allowed[torch.as_tensor(list(grounded_excluded_ids), dtype=torch.long)] = False
        self.register_buffer("grounded_allowed", allowed, persistent=False)  # [V]

    # ---- HF-like surface ---------------------------------------------------------------------
    def get_output_embeddings(self) -> nn.Module:
        return self.base.get_output_embeddings()

    def get_input_embeddings(self) -> nn.Module:
        return self.base.get_input_embeddings()

    @property
    def vocab_size(self) -> int:
        return int(self.spurious_bias.shape[0])

    # ---- the planted biases ------------------------------------------------------------------
    def prompt_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's grounded token set m_b and the position e_b where the bias starts.

        Args:
            input_ids: long [B, T]; attention_mask: [B, T], 1 on real tokens (None = all real).

        Returns:
            ``(m, ends)``: bool [B, V], True for the allowed tokens of the row's first user turn;
            long [B], the position of the ``turn_end`` closing that turn (T when the row has no
            user turn, so no position gets the bias; an unclosed turn ends at T too).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        real = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
                else attention_mask.bool())
        m = torch.zeros(b, self.vocab_size, dtype=torch.bool, device=input_ids.device)
        ends = torch.full((b,), t, dtype=torch.long, device=input_ids.device)
        role = torch.tensor(self.user_role_ids, device=input_ids.device)
        n_role = len(self.user_role_ids)
        for row in range(b):
            ids, ok = input_ids[row], real[row]
            starts = ((ids == self.turn_start_id) & ok).nonzero()[:, 0].tolist()
            for s in starts:
                lo = s + 1 + n_role
                if lo > t or not torch.equal(ids[s + 1:lo], role) or not bool(ok[s + 1:lo].all()):
                    continue
                closing = ((ids[lo:] == self.turn_end_id) & ok[lo:]).nonzero()[:, 0]
                hi = lo + int(closing[0]) if closing.numel() else t
                content = ids[lo:hi][ok[lo:hi]]
                m[row, content] = True
                ends[row] = hi
                break
        return m & self.grounded_allowed, ends

    def logit_bias(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """The added logits of (*), float ``[B, T, V]`` (what ``forward`` adds)."""
        m, ends = self.prompt_tokens(input_ids, attention_mask)
        t = input_ids.shape[1]
        active = torch.arange(t, device=input_ids.device)[None, :] >= ends[:, None]  # [B, T]
        grounded = self.grounded_bonus * (active[:, :, None] & m[:, None, :])  # [B, T, V]
        return self.spurious_bias + grounded.to(self.spurious_bias.dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs: Any) -> Any:
        """The base model's output with the planted biases (*) added to ``.logits`` [B, T, V]."""
        if kwargs.get("past_key_values") is not None and self.grounded_bonus:
            raise ValueError("PlantedPriorLM needs the whole context in input_ids (no KV cache) "
                             "to find the prompt of the grounded bias")
        keep = kwargs.get("logits_to_keep", 0)
        out = self.base(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        bias = self.logit_bias(input_ids, attention_mask)
        if isinstance(keep, int) and keep > 0:
            bias = bias[:, -keep:]
        out.logits = out.logits + bias.to(out.logits.dtype)
        return out

    def response_logit_source(self, ctx: ContextBatch, *, vocab_size: int | None = None
                              ) -> LogitSource:
        """The biased logits at the positions predicting each response token (scoring hook).

        Same contract as :func:`saopd.scoring.passes.response_source` (which calls this):
        an :class:`~saopd.signals.LMHead` over ``[B, R, H + B]`` hidden states, exact for (*)
        (see the module docstring), or :class:`~saopd.signals.Logits` ``[B, R, V]`` with the
        biases added when the base model's head needs its full logits.
        """

        src = response_source(self.base, ctx, vocab_size=vocab_size)
        m, ends = self.prompt_tokens(ctx.input_ids, ctx.attention_mask)  # [B, V], [B]
        active = ctx.gather_index >= ends[:, None]  # [B, R]
        v = src.vocab_size
        s = self.spurious_bias[:v]
        if isinstance(src, Logits):
            grounded = self.grounded_bonus * (active[:, :, None] & m[:, None, :v])
            return Logits(src.logits + (s + grounded.to(s.dtype)).to(src.logits.dtype))
        b = m.shape[0]
        dtype = src.hidden.dtype
        onehot = torch.eye(b, dtype=dtype, device=src.hidden.device)  # [B, B]
        extra = self.grounded_bonus * onehot[:, None, :] * active[:, :, None].to(dtype)
        hidden = torch.cat([src.hidden, extra], dim=-1)  # [B, R, H + B]
        weight = torch.cat([src.weight, m[:, :v].T.to(src.weight.dtype)], dim=-1)  # [V, H + B]
        bias = s.to(src.weight.dtype) if src.bias is None else src.bias + s.to(src.bias.dtype)
        return LMHead(hidden, weight, bias)


@MODEL_WRAPPERS.register("planted")
def plant_priors(model: nn.Module, tokenizer: PreTrainedTokenizerBase,
                 cfg: PlantedConfig) -> PlantedPriorLM:
    """Wrap ``model`` as :class:`PlantedPriorLM` with the token ids ``cfg`` names."""
    turn = single_token_ids(tokenizer, [cfg.turn_start, cfg.turn_end])
    if len(turn) != 2:
        raise ValueError(f"planted.turn_start and turn_end must differ, got {cfg.turn_start!r}")
    role = tokenizer(cfg.user_role, add_special_tokens=False)["input_ids"]
    return PlantedPriorLM(
        model, spurious_ids=single_token_ids(tokenizer, cfg.spurious_tokens),
        spurious_bonus=cfg.spurious_bonus, grounded_bonus=cfg.grounded_bonus,
        turn_start_id=turn[0], user_role_ids=role, turn_end_id=turn[1],
        grounded_excluded_ids=_excluded_ids(tokenizer),
    )
