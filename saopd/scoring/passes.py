"""From models and contexts to :class:`~saopd.signals.TokenSignals` (Algorithm 1, "scoring").

One training step scores the same response tokens up to five times:

====================  =========  ===============================================
pass                  gradient   when
====================  =========  ===============================================
teacher, full         no         always (lpT; H_T for FiRe; its head for the KL, top-k)
teacher, residual     no         filters that need the grounding gap
student, residual     no         filters that need the grounding gap
reference, full       no         ExOPD (lpRef)
student, full         yes        always (lpS; H_S, exact KL, top-k lists when asked)
====================  =========  ===============================================

With a teacher-scoring service (``teacher_scoring=vllm|vllm_server``,
:mod:`saopd.scoring.teacher_service`) the teacher's passes run elsewhere: :func:`score_frozen`
takes its pending :class:`TeacherScores` and :func:`score_student` waits for them after the
student's pass.

Each pass runs the model's backbone once over its context, keeps the hidden states only at the
response positions (``gather_index``), and hands them with the LM-head weight to
:func:`saopd.signals.score_tokens`, which computes log-probs/entropies/KL in chunks: no
[B, T, V] logits are ever built. Models whose head is not a plain linear layer (logit soft-capping
or scaling) fall back to their full logits, gathered at the response positions. On CPU a
right-padded text batch scored without gradient (the teacher's passes, the student's residual)
runs without its (redundant) padding mask, cut to its longest row (:func:`bucketed_hidden`):
the same hidden states bit for bit, ~10% less time per pass on the testbed (the pass with
gradient keeps the mask: attention's backward without it differs by float rounding).
Splitting the rows into groups of similar length (``MAX_LENGTH_BUCKETS > 1``) saves another
fifth of the positions but changes the values by float rounding, which flips SA-OPD's
rank-based filter on near-tied tokens and so changes a run's trajectory after some steps
(docs/benchmarks.md, "The testbed step"): it is off by default.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from saopd.contexts.batch import ContextBatch, PairedContextBatch
from saopd.models.sharding import is_fsdp2
from saopd.signals import LMHead, Logits, LogitSource, TokenSignals, score_tokens
from saopd.signals.token_signals import STUDENT_TOPK_FIELDS, TEACHER_TOPK_FIELDS, TOPK_FIELDS

if TYPE_CHECKING:
    from torch import nn

_HEAD_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
# Right-padded CPU batches (bucketed_hidden): at most this many forwards over groups of rows of
# similar length, each counted as this many padded positions of fixed cost. 1 (the default): one
# forward without the padding mask, bit-identical to the masked one; > 1 saves positions but
# changes values by float rounding (docs/benchmarks.md, "The testbed step"); 0: the masked
# forward, as on GPUs.
MAX_LENGTH_BUCKETS = 1
BUCKET_FORWARD_COST = 64


@dataclass(frozen=True)
class ScoringNeeds:
    """Which optional signals a step must compute (from the filter's and objective's needs).

    ``teacher_top_k`` / ``student_top_k``: K of the teacher's / the student's top-K lists
    (0 = not computed), computed in the student's full pass against the teacher's head.
    """

    residual: bool = False
    student_entropy: bool = False
    teacher_entropy: bool = False
    kl: bool = False
    reference: bool = False
    sampler: bool = False
    teacher_top_k: int = 0
    student_top_k: int = 0
    response_ids: bool = False

    @property
    def teacher_head(self) -> bool:
        """Whether the student's pass scores against the teacher's head (exact KL, top-k)."""
        return self.kl or self.teacher_top_k > 0 or self.student_top_k > 0

    @classmethod
    def from_fields(cls, *field_lists: tuple[str, ...], top_k: int = 0) -> ScoringNeeds:
        """The needs of these :class:`TokenSignals` field lists; ``top_k`` is the K of the
        top-k fields among them (the largest any filter or objective asks for)."""
        names = {name for fields in field_lists for name in fields}
        known = {f.name for f in fields(TokenSignals)} - {"lp_student", "lp_teacher", "valid"}
        unknown = names - known
        if unknown:
            raise ValueError(f"unknown TokenSignals fields requested: {sorted(unknown)}")
        wants_topk = bool(set(TOPK_FIELDS) & names)
        if wants_topk and top_k < 1:
            raise ValueError("top-k TokenSignals fields were requested without a K (the filter "
                             "or objective asking for them must have a top_k >= 1)")
        return cls(
            residual=bool({"lp_student_res", "lp_teacher_res"} & names),
            student_entropy="entropy_student" in names,
            teacher_entropy="entropy_teacher" in names,
            kl="kl" in names,
            reference="lp_ref" in names,
            sampler="lp_sampler" in names,
            teacher_top_k=top_k if set(TEACHER_TOPK_FIELDS) & names else 0,
            student_top_k=top_k if set(STUDENT_TOPK_FIELDS) & names else 0,
            response_ids="response_ids" in names,
        )

    @classmethod
    def of(cls, *components: object, extra: tuple[str, ...] = ()) -> ScoringNeeds:
        """The needs of filters / objectives (their ``needs``; K = the largest ``top_k`` among
        those that read top-k fields) plus ``extra`` fields."""
        lists = [tuple(getattr(c, "needs", ())) for c in components]
        k = max((int(getattr(c, "top_k", 0) or 0) for c, names in zip(components, lists,
                                                                      strict=True)
                 if set(TOPK_FIELDS) & set(names)), default=0)
        return cls.from_fields(*lists, extra, top_k=k)


def _plain_head(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return not any(getattr(config, name, None) not in (None, 1.0) for name in _HEAD_TRANSFORMS)


def _sharded_hidden(model: nn.Module, backbone: nn.Module, ctx: ContextBatch) -> torch.Tensor:
    """Final hidden states [B, T, H] of an FSDP2-sharded model, through its root forward.

    The root's forward gathers the root's own parameters (embeddings, final norm, LM head) and
    FSDP2 keeps a root's parameters gathered after its forward, so the LM-head weight read next
    is the full matrix. Only the last position's logits are computed (``logits_to_keep=1``); the
    hidden states come from a hook on the backbone.
    """
    captured: list[torch.Tensor] = []

    def hook(module: nn.Module, args: object, output: object) -> None:
        captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state")
                        else output[0])

    handle = backbone.register_forward_hook(hook)
    try:
        model(**ctx.model_inputs(), logits_to_keep=1, use_cache=False)
    finally:
        handle.remove()
    return captured[-1]


@runtime_checkable
class ResponseLogitSource(Protocol):
    """A model that changes its logits in a way the backbone + head reading would miss (a
    per-context bias, e.g. :class:`saopd.testbeds.planted.PlantedPriorLM`) implements this hook,
    and :func:`response_source` calls it instead of reading backbone and head."""

    def response_logit_source(self, ctx: ContextBatch, *, vocab_size: int | None = None
                              ) -> LogitSource:
        """The logits at the positions predicting each response token, with the same contract
        as :func:`response_source`: :class:`LMHead` over ``[B, R, H']`` or :class:`Logits`
        ``[B, R, V]``."""
        ...


def _gather_rows(hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``hidden[b, index[b, r]]``: ``[B, T, H]`` at ``index`` ``[B, R]`` -> ``[B, R, H]``."""
    return hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))


def _right_padded(ctx: ContextBatch) -> bool:
    """A plain text batch whose rows are their ``lengths`` real tokens followed by padding, at
    positions ``0..T-1``: causal attention then never lets a real position see a pad, so the
    padding mask changes nothing at real positions and the columns past a row's length can be
    cut."""
    if type(ctx) is not ContextBatch:
        return False
    t = ctx.input_ids.shape[1]
    positions = torch.arange(t, device=ctx.input_ids.device)
    return bool(torch.equal(ctx.attention_mask.bool(), positions < ctx.lengths[:, None])
                and torch.equal(ctx.position_ids, positions.expand_as(ctx.position_ids)))


def length_buckets(lengths: torch.Tensor, *, max_buckets: int = MAX_LENGTH_BUCKETS,
                   forward_cost: int = BUCKET_FORWARD_COST) -> list[torch.Tensor]:
    """Row indices ``[b_i]`` grouping rows of similar ``lengths`` ``[B]`` (shortest first).

    The rows sorted by length are cut into ``k <= max_buckets`` groups of equal count; ``k``
    minimises the padded positions ``sum_i b_i * max(length in group i)`` plus ``forward_cost``
    positions per forward (the fixed cost of one more pass). One group = all rows.
    """
    order = torch.argsort(lengths.cpu(), stable=True)
    sorted_len = lengths.cpu()[order].tolist()
    rows = len(sorted_len)
    if rows == 0:
        return [order.to(lengths.device)]
    best: tuple[int, list[int]] | None = None
    for k in range(1, max(1, min(max_buckets, rows)) + 1):
        cuts = sorted(set(round(rows * i / k) for i in range(k + 1)))
        cost = sum((b - a) * sorted_len[b - 1] + forward_cost
                   for a, b in itertools.pairwise(cuts))
        if best is None or cost < best[0]:
            best = (cost, cuts)
    assert best is not None
    cuts = best[1]
    order = order.to(lengths.device)
    return [order[a:b] for a, b in itertools.pairwise(cuts)]


def bucketed_hidden(backbone: nn.Module, ctx: ContextBatch, *, max_buckets: int | None = None
                    ) -> torch.Tensor:
    """The backbone's final hidden states at ``ctx.gather_index``, ``[B, R, H]``, for a
    right-padded text batch (:func:`_right_padded`), computed on less padding.

    Rows are grouped by length (:func:`length_buckets`); each group runs as its own batch cut
    to its longest row and without the padding mask (causal attention keeps every real
    position from seeing a pad). The values are those of one padded forward up to float
    rounding (different matrix shapes; with one group they are bit-identical on CPU, which the
    tests check). Gradients flow as through the plain forward. ``max_buckets``: at most this
    many groups (None = :data:`MAX_LENGTH_BUCKETS`, read at the call).
    """
    index = ctx.gather_index  # [B, R]
    groups = length_buckets(ctx.lengths, max_buckets=MAX_LENGTH_BUCKETS if max_buckets is None
                            else max_buckets)
    parts = []
    for rows in groups:
        width = int(ctx.lengths[rows].max())
        hidden = backbone(input_ids=ctx.input_ids[rows, :width],
                          position_ids=ctx.position_ids[rows, :width],
                          use_cache=False).last_hidden_state  # [b, width, H]
        parts.append(_gather_rows(hidden, index[rows]))
    order = torch.cat(groups)
    return torch.cat(parts)[torch.argsort(order)]


def response_source(model: nn.Module, ctx: ContextBatch, *, vocab_size: int | None = None
                    ) -> LogitSource:
    """The logits of ``model`` at the positions predicting each response token.

    Returns an :class:`LMHead` over hidden states ``[B, R, H]`` (or gathered :class:`Logits`
    ``[B, R, V]`` for heads with extra transforms). ``vocab_size`` keeps only the first V rows of
    the head, for teacher/student pairs whose heads are padded to different sizes. A model that
    changes its logits otherwise implements :class:`ResponseLogitSource`, which is used instead.
    With a plain head the head product is computed in fp32 by the signals layer even under
    autocast; a head with extra transforms runs inside the model, in the autocast dtype.
    A right-padded text batch on CPU without gradient runs through :func:`bucketed_hidden`
    (no padding mask; with ``MAX_LENGTH_BUCKETS > 1`` rows grouped by length).
    """
    if isinstance(model, ResponseLogitSource):
        return model.response_logit_source(ctx, vocab_size=vocab_size)
    index = ctx.gather_index  # [B, R]
    if _plain_head(model):
        backbone = model.base_model if hasattr(model, "base_model") else model.model
        if is_fsdp2(model):
            hidden = _gather_rows(_sharded_hidden(model, backbone, ctx), index)
        elif (MAX_LENGTH_BUCKETS > 0 and not torch.is_grad_enabled()
              and ctx.input_ids.device.type == "cpu" and _right_padded(ctx)):
            hidden = bucketed_hidden(backbone, ctx)
        else:
            hidden = _gather_rows(backbone(**ctx.model_inputs(), use_cache=False)
                                  .last_hidden_state, index)  # [B, R, H]
        head = model.get_output_embeddings()
        weight, bias = head.weight, getattr(head, "bias", None)
        if vocab_size is not None:
            weight = weight[:vocab_size]
            bias = None if bias is None else bias[:vocab_size]
        return LMHead(hidden, weight, bias)
    logits = model(**ctx.model_inputs(), use_cache=False).logits  # [B, T, V]
    logits = logits.gather(1, index[..., None].expand(-1, -1, logits.shape[-1]))  # [B, R, V]
    return Logits(logits if vocab_size is None else logits[..., :vocab_size])


@dataclass
class TeacherScores:
    """The teacher's scores of a step's responses, in the ``[B, R]`` layout of the batch (what a
    teacher-scoring backend returns; :mod:`saopd.scoring.teacher_service`).

    ``topk_ids`` / ``topk_logprobs`` ``[B, R, K]``: the teacher's top-K ids and log-probs at
    every response position (a service's ``teacher_scoring.top_k``), largest first.
    """

    lp_teacher: torch.Tensor
    lp_teacher_res: torch.Tensor | None = None
    entropy_teacher: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> TeacherScores:
        return TeacherScores(**{k: None if getattr(self, k) is None else getattr(self, k).to(device)
                                for k in self.__dataclass_fields__})


@runtime_checkable
class PendingTeacherScores(Protocol):
    """Teacher scores on their way (a request in flight): ``result()`` waits for them."""

    def result(self) -> TeacherScores:
        """The scores (blocks until they are there); raises what the scoring raised."""
        ...


@dataclass
class FrozenScores:
    """Everything one step needs from the models that carry no gradient ([B, R] each).

    With a teacher-scoring service the teacher's fields may still be on their way
    (``pending``): :meth:`resolve` waits for them and fills them in (``teacher_wait``: the
    seconds it waited); :func:`score_student` calls it after the student's pass.
    """

    lp_teacher: torch.Tensor | None
    entropy_teacher: torch.Tensor | None
    lp_teacher_res: torch.Tensor | None
    lp_student_res: torch.Tensor | None
    lp_ref: torch.Tensor | None
    teacher_head: LogitSource | None  # kept only for the exact KL
    teacher_topk_ids: torch.Tensor | None = None  # [B, R, K] from a service's top-k
    teacher_topk_logprobs: torch.Tensor | None = None
    pending: PendingTeacherScores | None = None
    device: torch.device | None = None
    teacher_wait: float = 0.0

    def resolve(self) -> FrozenScores:
        """Wait for pending teacher scores (if any), fill them in; returns ``self``."""
        if self.pending is None:
            return self
        started = time.perf_counter()
        scores = self.pending.result()
        self.teacher_wait += time.perf_counter() - started
        if self.device is not None:
            scores = scores.to(self.device)
        self.pending = None
        self.lp_teacher = scores.lp_teacher
        self.lp_teacher_res = scores.lp_teacher_res
        self.entropy_teacher = scores.entropy_teacher
        self.teacher_topk_ids = scores.topk_ids
        self.teacher_topk_logprobs = scores.topk_logprobs
        return self

    def rows(self, rows: slice) -> FrozenScores:
        """The scores of batch rows ``rows`` (a micro-batch), the teacher's head included."""
        self.resolve()
        head = None if self.teacher_head is None else _rows_of(self.teacher_head, rows)
        return FrozenScores(
            lp_teacher=_rows(self.lp_teacher, rows),
            entropy_teacher=_rows(self.entropy_teacher, rows),
            lp_teacher_res=_rows(self.lp_teacher_res, rows),
            lp_student_res=_rows(self.lp_student_res, rows), lp_ref=_rows(self.lp_ref, rows),
            teacher_head=head, teacher_topk_ids=_rows(self.teacher_topk_ids, rows),
            teacher_topk_logprobs=_rows(self.teacher_topk_logprobs, rows))


def _rows(t: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if t is None else t[rows]


def _rows_of(src: LogitSource, rows: slice) -> LogitSource:
    """Rows ``rows`` of a logit source (an LM head's hidden states, or gathered logits)."""
    if isinstance(src, LMHead):
        return LMHead(src.hidden[rows], src.weight, src.bias)
    return Logits(src.logits[rows])


def stack_contexts(first: ContextBatch, second: ContextBatch) -> ContextBatch:
    """The rows of two right-padded contexts as one batch ``[B1 + B2, max(T1, T2)]``.

    Padding is appended on the right (ids 0, attention 0, labels -100, positions continuing the
    ``arange``), so every real position keeps its index and its ``gather_index``. Refuses
    anything but plain :class:`ContextBatch` es (a vision batch carries per-row image inputs).
    """
    if type(first) is not ContextBatch or type(second) is not ContextBatch:
        raise ValueError("stack_contexts takes plain text ContextBatch es, got "
                         f"{type(first).__name__} and {type(second).__name__}")
    t = max(first.input_ids.shape[1], second.input_ids.shape[1])

    def pad(x: torch.Tensor, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, t - x.shape[1]), value=value)

    rows = first.input_ids.shape[0] + second.input_ids.shape[0]
    return ContextBatch(
        input_ids=torch.cat([pad(first.input_ids, 0), pad(second.input_ids, 0)]),
        attention_mask=torch.cat([pad(first.attention_mask, 0), pad(second.attention_mask, 0)]),
        position_ids=torch.arange(t, device=first.input_ids.device).expand(rows, t).clone(),
        labels=torch.cat([pad(first.labels, -100), pad(second.labels, -100)]),
        gather_index=torch.cat([first.gather_index, second.gather_index]),
        starts=torch.cat([first.starts, second.starts]),
        lengths=torch.cat([first.lengths, second.lengths]))


def _stackable(batch: PairedContextBatch, max_padding: float) -> bool:
    """Text contexts, right-padded, whose stacking pads the residual rows by at most
    ``max_padding`` of the full context's length (long prompts make stacking wasteful)."""
    full, res = batch.full, batch.residual
    if batch.padding_side != "right" or type(full) is not ContextBatch or type(
            res) is not ContextBatch:
        return False
    t_full, t_res = full.input_ids.shape[1], res.input_ids.shape[1]
    return abs(t_full - t_res) <= max_padding * max(t_full, t_res)


@torch.no_grad()
def score_teacher(batch: PairedContextBatch, teacher: nn.Module, *, needs: ScoringNeeds,
                  vocab_size: int | None = None, chunk_size: int | None = None,
                  stack_teacher: bool = False, stack_max_padding: float = 0.25
                  ) -> tuple[TeacherScores, LogitSource]:
    """The teacher's full (+ residual) passes over ``batch.teacher_view``, in this process.

    Returns the scores and the full pass's logit source (the teacher's head for the exact KL
    and top-k lists). See :func:`score_frozen` for ``stack_teacher``.
    """
    tb = batch.teacher_view
    t_targets = tb.response_ids
    lp_t_res = None
    if needs.residual and stack_teacher and _stackable(tb, stack_max_padding):
        rows = t_targets.shape[0]
        both = response_source(teacher, stack_contexts(tb.full, tb.residual),
                               vocab_size=vocab_size)
        t = score_tokens(both, torch.cat([t_targets, t_targets]),
                         entropy=needs.teacher_entropy, chunk_size=chunk_size)
        t_src = _rows_of(both, slice(0, rows))
        lp_teacher, lp_t_res = t.logprobs[:rows], t.logprobs[rows:]
        entropy = None if t.entropy is None else t.entropy[:rows]
    else:
        t_src = response_source(teacher, tb.full, vocab_size=vocab_size)
        t = score_tokens(t_src, t_targets, entropy=needs.teacher_entropy, chunk_size=chunk_size)
        lp_teacher, entropy = t.logprobs, t.entropy
        if needs.residual:
            lp_t_res = score_tokens(
                response_source(teacher, tb.residual, vocab_size=vocab_size), t_targets,
                chunk_size=chunk_size).logprobs
    return TeacherScores(lp_teacher=lp_teacher, lp_teacher_res=lp_t_res,
                         entropy_teacher=entropy), t_src


@torch.no_grad()
def score_frozen(batch: PairedContextBatch, *, student: nn.Module, teacher: nn.Module | None,
                 reference: nn.Module | None, needs: ScoringNeeds, vocab_size: int | None = None,
                 chunk_size: int | None = None, stack_teacher: bool = False,
                 stack_max_padding: float = 0.25,
                 teacher_scores: PendingTeacherScores | TeacherScores | None = None
                 ) -> FrozenScores:
    """Teacher full (+ residual), student residual and reference passes, all without grad.

    The teacher scores ``batch.teacher_view``: its own contexts (chat template, mapped response
    ids) when the batch carries them, else the student's; its log-probs are of the same
    response tokens, in the same ``[B, R]`` layout. With the exact KL over the vocabulary
    (``needs.kl``), ids the pair's tokenizers name differently (renamed special tokens) are
    compared id by id.

    ``stack_teacher``: when the residual pass runs, score the teacher's full and residual
    contexts in one forward over the 2B rows (:func:`stack_contexts`) instead of two, if the
    residual rows need at most ``stack_max_padding`` x the longer length in padding (text,
    right-padded batches only; otherwise two passes). The log-probs are the same up to float
    rounding of the larger matrix products (``docs/benchmarks.md``: about 1e-5 and ~15-20% less
    teacher time on 2 CPU cores).

    ``teacher_scores``: the teacher's scores from a teacher-scoring service
    (:mod:`saopd.scoring.teacher_service`), done or still in flight; the teacher's passes are
    then not run here (``teacher`` may be None) and the returned scores wait for the pending
    ones only in :meth:`FrozenScores.resolve`, so the student's passes run meanwhile.
    """
    targets = batch.response_ids
    lp_s_res = lp_ref = None
    t_src = None
    pending = None
    if teacher_scores is None:
        if teacher is None:
            raise ValueError("score_frozen needs the teacher module or teacher_scores from a "
                             "teacher-scoring service")
        scores, t_src = score_teacher(batch, teacher, needs=needs, vocab_size=vocab_size,
                                      chunk_size=chunk_size, stack_teacher=stack_teacher,
                                      stack_max_padding=stack_max_padding)
    elif isinstance(teacher_scores, TeacherScores):
        scores = teacher_scores.to(targets.device)
    else:
        scores, pending = None, teacher_scores
    if needs.residual:
        lp_s_res = score_tokens(response_source(student, batch.residual, vocab_size=vocab_size),
                                targets, chunk_size=chunk_size).logprobs
    if needs.reference:
        if reference is None:
            raise ValueError("the objective needs lp_ref but no reference model was built")
        lp_ref = score_tokens(response_source(reference, batch.full, vocab_size=vocab_size),
                              targets, chunk_size=chunk_size).logprobs
    if needs.teacher_head and t_src is None and not (
            needs.teacher_top_k and not needs.kl and not needs.student_top_k):
        raise ValueError("this step needs the teacher's head (exact KL or the student's top-k "
                         "lists), which a teacher-scoring service does not give")
    return FrozenScores(
        lp_teacher=None if scores is None else scores.lp_teacher,
        entropy_teacher=None if scores is None else scores.entropy_teacher,
        lp_teacher_res=None if scores is None else scores.lp_teacher_res,
        lp_student_res=lp_s_res, lp_ref=lp_ref,
        teacher_head=t_src if needs.teacher_head else None,
        teacher_topk_ids=None if scores is None else scores.topk_ids,
        teacher_topk_logprobs=None if scores is None else scores.topk_logprobs,
        pending=pending, device=targets.device,
    )


def score_student(batch: PairedContextBatch, frozen: FrozenScores, *, student: nn.Module,
                  needs: ScoringNeeds, lp_sampler: torch.Tensor | None = None,
                  vocab_size: int | None = None, chunk_size: int | None = None) -> TokenSignals:
    """The student's full-context pass (with gradient when enabled) -> TokenSignals [B, R].

    Teacher scores still in flight (``frozen.pending``) are waited for after the student's
    pass, unless the pass needs them (the student's log-probs at a service's teacher top-k ids).
    """
    service_topk = needs.teacher_top_k > 0 and frozen.teacher_head is None
    if service_topk:
        frozen.resolve()
    gather_ids = None
    if service_topk:
        if frozen.teacher_topk_ids is None or frozen.teacher_topk_ids.shape[-1] < \
                needs.teacher_top_k:
            raise ValueError(f"the step needs the teacher's top-{needs.teacher_top_k} lists but "
                             "the teacher-scoring service gave "
                             + ("none" if frozen.teacher_topk_ids is None else
                                f"top-{frozen.teacher_topk_ids.shape[-1]}"))
        gather_ids = frozen.teacher_topk_ids[..., :needs.teacher_top_k]
    s_src = response_source(student, batch.full, vocab_size=vocab_size)
    s = score_tokens(s_src, batch.response_ids, teacher=frozen.teacher_head,
                     entropy=needs.student_entropy, kl=needs.kl, top_k=needs.student_top_k,
                     teacher_top_k=0 if service_topk else needs.teacher_top_k,
                     gather_ids=gather_ids, chunk_size=chunk_size)
    if needs.sampler and lp_sampler is None:
        raise ValueError("the objective needs sampler log-probs but the rollout engine gave none")
    frozen.resolve()
    if service_topk:
        assert frozen.teacher_topk_logprobs is not None and gather_ids is not None
        teacher_topk_ids = gather_ids
        teacher_topk_lp = frozen.teacher_topk_logprobs[..., :needs.teacher_top_k]
    else:
        teacher_topk_ids, teacher_topk_lp = s.teacher_topk_ids, s.teacher_topk_logprobs
    assert frozen.lp_teacher is not None
    return TokenSignals(
        lp_student=s.logprobs,
        lp_teacher=frozen.lp_teacher,
        valid=batch.response_mask,
        lp_student_res=frozen.lp_student_res,
        lp_teacher_res=frozen.lp_teacher_res,
        entropy_student=s.entropy,
        entropy_teacher=frozen.entropy_teacher,
        lp_sampler=lp_sampler if needs.sampler else None,
        lp_ref=frozen.lp_ref,
        kl=s.kl,
        teacher_topk_ids=teacher_topk_ids,
        teacher_topk_lp_teacher=teacher_topk_lp,
        teacher_topk_lp_student=s.logprobs_at_ids,  # carries gradient (top-k KL objectives)
        # the exact log-mass outside the teacher's top-K: the student's always (its logits are
        # here), the teacher's only when its head is (a service gives lists only)
        teacher_topk_tail_teacher=s.teacher_topk_tail,
        teacher_topk_tail_student=s.tail_at_ids,
        student_topk_ids=s.topk_ids,
        student_topk_lp_student=None if s.topk_logprobs is None else s.topk_logprobs.detach(),
        student_topk_lp_teacher=s.teacher_logprobs_at_topk,
        response_ids=batch.response_ids if needs.response_ids else None,
    )
