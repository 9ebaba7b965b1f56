"""A teacher whose harmful prior is input-agnostic by construction: the tic testbed.

:class:`TicPriorLM` wraps a clean causal LM (the base teacher, which never writes the tic) and
mixes, **in probability space**, a fixed continuation keyed only on the response text: right
after the answer line (the first token ``answer_end``, ``}.`` of ``\\boxed{n}.``), with
probability ``r`` whatever the input, the response continues with the **tic**
(``\\nWait, the answer is \\boxed{0}.`` then EOS), a wrong re-answer that the grader reads as the
final answer. As a distribution over whole responses::

    P'(y) = P_T(y_<s) [(1 - r) P_T(y_>=s | y_<s) + r 1[y_>=s = tic + EOS]]            (*)

where ``s`` is the response's slot (the position after its first answer line); a response
without an answer line has no slot and ``P'(y) = P_T(y)``. Sampling from (*) is sampling from
the base teacher and, with probability r, replacing what follows the slot by the tic. Its
next-token distribution at a position ``j = s + k`` whose prefix ``y[s:j]`` equals the tic's
first ``k`` tokens (the prior is **active** there) is

    p'(v) = (1 - w_j) p_T(v) + w_j 1[v = tic_k],
    w_j = r / (r + (1 - r) P_T(tic_<k | x, y_<s)),                                   (**)

the posterior weight of the tic branch given the tokens so far (``w = r`` at the slot itself;
``P_T(tic_<k)`` is the product of the base teacher's probabilities of the tic's tokens already
written). Everywhere else ``p' = p_T``. Because the slot, the tic and ``w`` depend on the
response text only, the prior survives prompt removal: with a base teacher that never writes
the tic (``p_T(tic_0) ~ 0``), ``p'(tic_0) = r`` in the full and the residual context alike, so
the teacher's part of the grounding gap |A_full - A_res| (paper Eq. 14) is 0 there by
construction. ``r = 0`` is the identity: the control is the same wrapper at rate 0.

:func:`saopd.filters.oracle.tic_positions` finds, from the response ids, where the prior is
active and which tokens are the tic's; the same function defines the oracle filters (positive
controls, never methods) and the ground truth of the token records
(:mod:`saopd.testbeds.arithmetic`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from saopd.config.model import TicConfig
from saopd.filters.oracle import tic_positions, tic_token_ids
from saopd.models.factory import MODEL_WRAPPERS
from saopd.scoring.passes import response_source
from saopd.signals import LMHead, Logits, LogitSource

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from saopd.contexts.batch import ContextBatch

__all__ = ["TicPriorLM", "plant_tic"]


def _response_ids(ctx: ContextBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The response tokens ``[B, R]`` of a context (``labels`` at ``gather_index + 1``) and
    their validity (False in padded slots)."""
    ids = ctx.labels.gather(1, ctx.gather_index + 1)
    valid = ids >= 0
    return ids.clamp_min(0), valid


class TicPriorLM(nn.Module):
    """A causal LM with the tic prior (*) mixed into its next-token distributions.

    Args:
        base: the wrapped clean HF causal LM (``self.base``; frozen by the caller).
        rate: r of (*) in [0, 1); 0 = the base model unchanged (the control).
        answer_end_id: the token closing the answer line (the slot follows its first use).
        tic_ids: the tic's tokens, EOS last.

    Scoring goes through :meth:`response_logit_source` (saopd's scoring hook); ``forward``
    returns the base model's output and refuses ``rate > 0``, because the slot is defined on the
    response, which a plain forward does not delimit. ``config``, ``get_output_embeddings`` and
    ``get_input_embeddings`` are the base's.
    """

    def __init__(self, base: nn.Module, *, rate: float, answer_end_id: int,
                 tic_ids: Sequence[int]) -> None:
        super().__init__()
        if not 0.0 <= float(rate) < 1.0 or math.isnan(float(rate)):
            raise ValueError(f"tic.rate must be in [0, 1), got {rate!r}")
        head = base.get_output_embeddings()
        vocab = int(head.weight.shape[0])
        bad = [int(i) for i in [answer_end_id, *tic_ids] if not 0 <= int(i) < vocab]
        if bad or not tic_ids:
            raise ValueError(f"tic ids must be a non-empty list of ids in [0, {vocab}); "
                             f"bad: {bad}")
        self.base = base
        self.config = base.config
        self.rate = float(rate)
        self.answer_end_id = int(answer_end_id)
        self.tic_ids = [int(i) for i in tic_ids]

    def get_output_embeddings(self) -> nn.Module:
        return self.base.get_output_embeddings()

    def get_input_embeddings(self) -> nn.Module:
        return self.base.get_input_embeddings()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The base model's output; ``ValueError`` for ``rate > 0`` (see the class docstring)."""
        if self.rate > 0:
            raise ValueError("TicPriorLM mixes its prior at the response's slot, which only "
                             "saopd's scoring (response_logit_source) knows; it cannot run as a "
                             "plain forward or generate")
        return self.base(*args, **kwargs)

    def mixed_logprobs(self, logprobs: torch.Tensor, response_ids: torch.Tensor,
                       valid: torch.Tensor) -> torch.Tensor:
        """(**) applied to the base model's log-probs ``[B, R, V]`` (float) at the response
        positions; returns the mixture's log-probs, the same shape (unchanged where inactive)."""
        if self.rate == 0.0:
            return logprobs
        pos = tic_positions(response_ids, valid, self.answer_end_id, self.tic_ids)
        if not bool(pos.active.any()):
            return logprobs
        lp = logprobs.float()
        tok = lp.gather(2, response_ids[..., None])[..., 0]  # base log p_T(y_j), [B, R]
        on_tic = torch.where(pos.tic, tok, torch.zeros_like(tok))
        before = on_tic.cumsum(dim=1) - on_tic  # log P_T(tic_<k): the tic tokens before j
        log_r, log_1r = math.log(self.rate), math.log1p(-self.rate)
        norm = torch.logaddexp(torch.full_like(before, log_r), log_1r + before)
        log_w, log_1w = log_r - norm, log_1r + before - norm  # [B, R]
        tic = torch.as_tensor(self.tic_ids, dtype=torch.long, device=lp.device)
        target = tic[pos.offset.clamp_min(0)]  # tic_k at active positions, [B, R]
        mixed = lp + torch.where(pos.active, log_1w, torch.zeros_like(log_1w))[..., None]
        at_target = lp.gather(2, target[..., None])[..., 0]
        bumped = torch.logaddexp(at_target + log_1w, log_w)
        new = torch.where(pos.active, bumped, mixed.gather(2, target[..., None])[..., 0])
        return mixed.scatter(2, target[..., None], new[..., None])

    def response_logit_source(self, ctx: ContextBatch, *, vocab_size: int | None = None
                              ) -> LogitSource:
        """The mixture's log-probs at the positions predicting each response token, as
        :class:`~saopd.signals.Logits` ``[B, R, V]`` (log-probs are valid logits); the base
        model's source unchanged at ``rate == 0``. Materialises ``[B, R, V]``: meant for the
        testbed's small vocabularies."""
        src = response_source(self.base, ctx, vocab_size=vocab_size)
        if self.rate == 0.0:
            return src
        if isinstance(src, LMHead):
            logits = src.hidden.float() @ src.weight.float().T
            if src.bias is not None:
                logits = logits + src.bias.float()
        else:
            assert isinstance(src, Logits)
            logits = src.logits.float()
        ids, valid = _response_ids(ctx)
        return Logits(self.mixed_logprobs(torch.log_softmax(logits, dim=-1), ids, valid))


@MODEL_WRAPPERS.register("tic")
def plant_tic(model: nn.Module, tokenizer: PreTrainedTokenizerBase, cfg: TicConfig
              ) -> TicPriorLM:
    """Wrap ``model`` as :class:`TicPriorLM` with the tic ``cfg`` names."""
    end, ids = tic_token_ids(tokenizer, cfg.text, cfg.answer_end)
    return TicPriorLM(model, rate=cfg.rate, answer_end_id=end, tic_ids=ids)


