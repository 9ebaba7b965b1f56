"""The two vLLM teacher backends' common part: the step's contexts as token-id prompts, and
vLLM's prompt log-probs back as the step's ``[B, R]`` teacher scores.

:class:`~saopd.vllm.teacher.VLLMTeacherScorer` (``teacher_scoring=vllm``) and
:class:`~saopd.vllm.client.teacher.VLLMServerTeacherScorer` (``vllm_server``) send each
row's real context ids (padding removed, either side: :func:`context_prompts`) and read vLLM's
``prompt_logprobs[j]``, the log-prob of prompt token ``j`` given the tokens before it (``None``
at ``j = 0``); the response token of slot ``r`` sits at padded position ``gather_index[r] + 1``,
i.e. at the real-token index ``cumsum(attention_mask) - 1`` there
(:func:`response_token_index`). :func:`scores_from_prompt_logprobs` gathers each row's
response slots (and, with the top-k approximation, the top-K entries per position: the
teacher's own top K, ties to the smaller id), :func:`topk_entropy` is the entropy over the top
K and one tail bucket (a lower bound), :func:`assemble_scores` makes the
:class:`~saopd.scoring.passes.TeacherScores`, and :func:`top_k_for` says which K a step needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from saopd.contexts.batch import ContextBatch
from saopd.scoring.passes import ScoringNeeds, TeacherScores

__all__ = [
    "assemble_scores",
    "collapse_images",
    "context_prompts",
    "context_scores",
    "json_entry",
    "response_token_index",
    "scores_from_prompt_logprobs",
    "top_k_for",
    "topk_entropy",
]



def context_prompts(ctx: ContextBatch) -> list[list[int]]:
    """Each row's real context ids (padding removed, either side)."""
    mask = ctx.attention_mask.bool().cpu()
    ids = ctx.input_ids.cpu()
    return [ids[b][mask[b]].tolist() for b in range(ids.shape[0])]


def response_token_index(ctx: ContextBatch) -> torch.Tensor:
    """``[B, R]`` index, among each row's real tokens, of the token of response slot ``r``
    (the token at padded position ``gather_index + 1``); 0 in padded slots is not meaningful."""
    mask = ctx.attention_mask.cpu()
    real = mask.cumsum(-1) - 1  # [B, T] index among the real tokens
    pos = (ctx.gather_index.cpu() + 1).clamp(max=mask.shape[1] - 1)
    return real.gather(1, pos)


def _topk_of(entry: Mapping[int, float], k: int) -> tuple[list[int], list[float]]:
    """The ``k`` largest entries (ties: the smaller id first), padded if fewer came back."""
    best = sorted(entry.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
    ids = [i for i, _ in best] + [0] * (k - len(best))
    lps = [v for _, v in best] + [-math.inf] * (k - len(best))
    return ids, lps


def scores_from_prompt_logprobs(
        rows: Sequence[Sequence[Mapping[int, float]]], targets: torch.Tensor,
        mask: torch.Tensor, *, top_k: int = 0, where: str = "the teacher service",
        error: type[Exception] = ValueError
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(lp [B, R], topk_ids [B, R, K] | None, topk_lp [B, R, K] | None)`` from each row's
    prompt log-probs at its response positions (``rows[b][r]``: ``{token id: log-prob}`` of
    response slot ``r``, for the valid slots of ``mask``). The target token must be among them
    (``error``, naming ``where``, otherwise); padded slots hold 0 (ids 0, log-probs -inf)."""
    b, r = targets.shape
    lp = torch.zeros((b, r), dtype=torch.float32)
    ids = torch.zeros((b, r, top_k), dtype=torch.long) if top_k else None
    tlp = torch.full((b, r, top_k), -math.inf, dtype=torch.float32) if top_k else None
    tgt = targets.cpu().tolist()
    valid = mask.cpu().tolist()
    for i in range(b):
        n = sum(valid[i])
        if len(rows[i]) != n:
            raise error(f"{where}: row {i} came back with {len(rows[i])} "
                                      f"response log-probs, expected {n}")
        for j, entry in enumerate(rows[i]):
            token = tgt[i][j]
            if token not in entry:
                raise error(
                    f"{where}: row {i}, response token {j} (id {token}) has no prompt log-prob "
                    f"(got ids {sorted(entry)[:8]}): the service scored other ids than it was "
                    "sent")
            lp[i, j] = float(entry[token])
            if top_k:
                assert ids is not None and tlp is not None
                top_ids, top_lps = _topk_of(entry, top_k)
                ids[i, j] = torch.tensor(top_ids)
                tlp[i, j] = torch.tensor(top_lps)
    return lp, ids, tlp


def context_scores(
        prompt_logprobs: Sequence[Sequence[Any]], index: Sequence[torch.Tensor],
        targets: torch.Tensor, mask: torch.Tensor, *, entry: Callable[[Any], Mapping[int, float]],
        top_k: int, where: str, error: type[Exception]
) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """The parts :func:`assemble_scores` takes: :func:`scores_from_prompt_logprobs` of each
    context (the full one, then the residual one). ``prompt_logprobs[n]`` holds prompt ``n``'s
    log-prob entries, one a position, each made a ``{token id: log-prob}`` by ``entry``; the
    prompts are the contexts' rows in turn (``targets.shape[0]`` a context), and ``index[c]``
    (:func:`response_token_index`) says where context ``c``'s response tokens stand."""
    b = targets.shape[0]
    rows = []
    for n, entries in enumerate(prompt_logprobs):
        c, i = divmod(n, b)
        rows.append([entry(entries[j]) for j in index[c][i][mask[i]].tolist()])
    return [scores_from_prompt_logprobs(rows[c * b:(c + 1) * b], targets, mask, top_k=top_k,
                                        where=where, error=error)
            for c in range(len(index))]


def topk_entropy(topk_lp: torch.Tensor) -> torch.Tensor:
    """The entropy ``[B, R]`` of the distribution made of the top-K probabilities and one
    bucket with the rest (``1 - sum``): a lower bound of the full distribution's entropy."""
    p = topk_lp.float().exp()
    inner = -(p * topk_lp.float().clamp(min=-1e4)).nan_to_num(0.0).sum(-1)
    tail = (1.0 - p.sum(-1)).clamp(min=0.0)
    return inner - torch.where(tail > 0, tail * tail.clamp(min=1e-30).log(),
                               torch.zeros_like(tail))


def assemble_scores(parts: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]],
              needs: ScoringNeeds, top_k: int) -> TeacherScores:
    """TeacherScores from the full (and residual) parts."""
    (lp, ids, tlp), res = parts[0], (parts[1] if len(parts) > 1 else None)
    entropy = topk_entropy(tlp) if needs.teacher_entropy and tlp is not None else None
    return TeacherScores(lp_teacher=lp, lp_teacher_res=None if res is None else res[0],
                         entropy_teacher=entropy,
                         topk_ids=ids if needs.teacher_top_k else None,
                         topk_logprobs=tlp if needs.teacher_top_k else None)


def top_k_for(needs: ScoringNeeds, top_k: int, where: str) -> int:
    """The K a request must ask for (0 = sampled tokens only); ``ValueError`` when the step
    needs more than the service was configured to give."""
    want = max(needs.teacher_top_k, 1 if needs.teacher_entropy else 0)
    if needs.kl or needs.student_top_k:
        raise ValueError(f"{where}: the step needs the teacher's whole distribution (exact KL "
                         "or the student's top-k lists); a teacher service cannot give it")
    if want > top_k:
        raise ValueError(f"{where}: the step needs the teacher's top-{want} log-probs (or its "
                         f"entropy) but teacher_scoring.top_k is {top_k}")
    return top_k if want else 0



def collapse_images(ids: Sequence[int], image_id: int) -> list[int]:
    """``ids`` with every run of ``image_id`` collapsed to one (the unexpanded prompt)."""
    out: list[int] = []
    for t in ids:
        if t == image_id and out and out[-1] == image_id:
            continue
        out.append(int(t))
    return out


def json_entry(entry: Any, error: type[Exception] = ValueError) -> dict[int, float]:
    """``{id: log-prob}`` of one position of a JSON ``prompt_logprobs`` list (``{"<id>":
    {"logprob": x, ...}}``; vLLM writes -inf as -9999); ``error`` for anything else."""
    if not isinstance(entry, dict):
        raise error(f"a teacher server returned a prompt log-prob entry "
                    f"{str(entry)[:200]}, not a mapping of token ids")
    out = {}
    for key, value in entry.items():
        lp = value.get("logprob") if isinstance(value, dict) else value
        out[int(key)] = float(lp)
    return out
