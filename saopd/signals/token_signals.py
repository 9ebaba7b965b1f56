"""Per-token signals of one batch of student rollouts, the input of every filter and objective.

Notation follows the paper (``../shared/paper/sa-opd.tex``, Sec. 3) and ``BASELINES.md``: for each
valid response token t of a rollout y ~ pi_S(.|x),

- ``lp_student``   = log pi_S(y_t | x, y_<t)            (may carry gradient: the student full pass)
- ``lp_teacher``   = log pi_T(y_t | x, y_<t)
- ``lp_student_res`` / ``lp_teacher_res``: the same with the task input removed (residual context)
- ``a_full``  = lp_student - lp_teacher                  (Eq. 12, stop-gradient)
- ``a_res``   = lp_student_res - lp_teacher_res          (Eq. 13)
- ``grounding_gap`` = |a_full - a_res|                   (Eq. 14, the input-grounding gap)

All tensors are ``[B, T]`` over response positions, except the optional top-k fields, which are
``[B, T, K]`` (K candidate ids per position); ``valid`` is a bool ``[B, T]`` mask, True where the
position holds a real response token (False = padding or prompt). Values at invalid positions are
ignored: they are replaced by 0 (ids by 0) on construction, so padding can never change a result.

Top-k fields (``BASELINES.md``: Token Teachability, Entropy-Aware OPD, the top-k KL objectives)
come in two groups, each given whole or not at all:

- the teacher's top-K: ``teacher_topk_ids`` (int64), ``teacher_topk_lp_teacher`` = log pi_T at
  them, ``teacher_topk_lp_student`` = log pi_S at them (may carry gradient);
- the student's top-K: ``student_topk_ids``, ``student_topk_lp_student`` = log pi_S at them,
  ``student_topk_lp_teacher`` = log pi_T at them (both constants).

Columns are ordered by the owning model's log-prob, descending, ties by smaller id
(``saopd.signals.logprobs``), so ``[..., :k]`` of a top-K group is the top-k group for k <= K.
The ids of one position must be distinct (checked at valid positions).

With the teacher's group, two optional ``[B, T]`` fields hold the exact log-mass outside its K
ids, computed over the whole vocabulary where the logits were at hand (the chunked scoring):
``teacher_topk_tail_teacher`` = log sum_{v not listed} pi_T(v) (absent when the teacher's lists
came from a teacher-scoring service) and ``teacher_topk_tail_student`` = the same under pi_S
(may carry gradient). Without them a tail is derived from the list alone, which cannot resolve
a tail below ~1e-6 (``saopd.signals.topk``).

Log-probabilities are stored in float32 whatever their input dtype (fp16/bf16 are upcast), and are
clamped from below at :data:`LOGPROB_FLOOR`, so a teacher that gives a sampled token zero
probability (log-prob ``-inf``) yields a large but finite divergence instead of ``inf``/``NaN``.
A NaN at a valid position is an error, never silently propagated.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from saopd.validation import check_float_tensor, check_same_shape

LOGPROB_FLOOR: float = -100.0
"""Lower clamp for every log-probability, in nats. exp(-100) ~ 3.7e-44 lies below the smallest
normal float32, so nothing representable as a probability is changed; only ``-inf`` (and
vanishing probabilities) are lifted to it, which bounds |A_t| by about 100 per token."""

TEACHER_TOPK_FIELDS: tuple[str, ...] = ("teacher_topk_ids", "teacher_topk_lp_teacher",
                                         "teacher_topk_lp_student")
"""The teacher's top-K group of :class:`TokenSignals` fields (given together or not at all)."""
STUDENT_TOPK_FIELDS: tuple[str, ...] = ("student_topk_ids", "student_topk_lp_student",
                                        "student_topk_lp_teacher")
"""The student's top-K group of :class:`TokenSignals` fields (given together or not at all)."""
TOPK_FIELDS: tuple[str, ...] = TEACHER_TOPK_FIELDS + STUDENT_TOPK_FIELDS
"""Every ``[B, T, K]`` field of :class:`TokenSignals`."""
TEACHER_TOPK_TAIL_FIELDS: tuple[str, ...] = ("teacher_topk_tail_teacher",
                                             "teacher_topk_tail_student")
"""The exact tails of the teacher's top-K group (``[B, T]``, each optional, only with the
group)."""

_LOGPROB_FIELDS = ("lp_student", "lp_teacher", "lp_student_res", "lp_teacher_res",
                   "lp_sampler", "lp_ref", "teacher_topk_lp_teacher", "teacher_topk_lp_student",
                   "student_topk_lp_student", "student_topk_lp_teacher",
                   *TEACHER_TOPK_TAIL_FIELDS)
_NONNEG_FIELDS = ("entropy_student", "entropy_teacher", "kl")
_ID_FIELDS = ("teacher_topk_ids", "student_topk_ids", "response_ids")


@dataclass
class TokenSignals:
    """Per-token log-probs and derived divergences of one batch; all fields ``[B, T]``.

    Required: ``lp_student``, ``lp_teacher``, ``valid``. Optional fields are ``None`` when the
    step did not compute them (vanilla OPD has no residual pass). ``lp_student`` and ``kl`` may
    carry gradient (the student's full-context pass); every other field is treated as a constant.

    Fields:
        lp_student: log pi_S(y_t | x, y_<t).
        lp_teacher: log pi_T(y_t | x, y_<t).
        valid: bool, True = a real response token of the batch (the set V of Eq. 17).
        lp_student_res, lp_teacher_res: log-probs under the residual (input-removed) context at
            the same response positions (Eq. 13). Given together or not at all.
        entropy_student, entropy_teacher: full-vocabulary entropies H_S, H_T (nats).
        lp_sampler: log-prob of y_t under the rollout engine (vLLM), for the importance ratio.
        lp_ref: log-prob under a frozen reference copy of the initial student (ExOPD).
        kl: exact per-token KL(pi_S || pi_T) over the vocabulary (Eq. 1 / Eq. 19 integrand).
        teacher_topk_ids: int64 ``[B, T, K]``, the teacher's K most probable token ids.
        teacher_topk_lp_teacher: ``[B, T, K]`` log pi_T at ``teacher_topk_ids`` (descending).
        teacher_topk_lp_student: ``[B, T, K]`` log pi_S at ``teacher_topk_ids``; may carry
            gradient (the student's full-context pass), for the top-k KL objectives.
        student_topk_ids: int64 ``[B, T, K']``, the student's K' most probable token ids.
        student_topk_lp_student: ``[B, T, K']`` log pi_S at ``student_topk_ids`` (descending).
        student_topk_lp_teacher: ``[B, T, K']`` log pi_T at ``student_topk_ids``.
        teacher_topk_tail_teacher: log pi_T of every id outside ``teacher_topk_ids``, exact
            (over the vocabulary); None when only the teacher's lists are known.
        teacher_topk_tail_student: log pi_S of every id outside ``teacher_topk_ids``, exact;
            may carry gradient (the student's full-context pass).
        response_ids: int64 ``[B, T]``, the sampled tokens y_t themselves (for filters that
            name tokens, e.g. a testbed's ground-truth oracle); 0 at invalid positions.
    """

    lp_student: torch.Tensor
    lp_teacher: torch.Tensor
    valid: torch.Tensor
    lp_student_res: torch.Tensor | None = None
    lp_teacher_res: torch.Tensor | None = None
    entropy_student: torch.Tensor | None = None
    entropy_teacher: torch.Tensor | None = None
    lp_sampler: torch.Tensor | None = None
    lp_ref: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    teacher_topk_ids: torch.Tensor | None = None
    teacher_topk_lp_teacher: torch.Tensor | None = None
    teacher_topk_lp_student: torch.Tensor | None = None
    student_topk_ids: torch.Tensor | None = None
    student_topk_lp_student: torch.Tensor | None = None
    student_topk_lp_teacher: torch.Tensor | None = None
    teacher_topk_tail_teacher: torch.Tensor | None = None
    teacher_topk_tail_student: torch.Tensor | None = None
    response_ids: torch.Tensor | None = None

    def __post_init__(self) -> None:
        valid = self.valid
        if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool:
            got = valid.dtype if isinstance(valid, torch.Tensor) else type(valid).__name__
            raise ValueError(f"valid must be a bool tensor [B, T], got {got}")
        if valid.dim() != 2:
            raise ValueError(f"valid must be 2-D [B, T], got shape {tuple(valid.shape)}")
        if (self.lp_student_res is None) != (self.lp_teacher_res is None):
            raise ValueError(
                "lp_student_res and lp_teacher_res must be given together (the residual pass "
                "scores both models), got only one of them"
            )
        for group in (TEACHER_TOPK_FIELDS, STUDENT_TOPK_FIELDS):
            given = [n for n in group if getattr(self, n) is not None]
            if given and len(given) != len(group):
                raise ValueError(
                    f"{list(group)} must be given together (one top-k group), got only {given}")
        tails = [n for n in TEACHER_TOPK_TAIL_FIELDS if getattr(self, n) is not None]
        if tails and self.teacher_topk_ids is None:
            raise ValueError(f"{tails} are the tails of the teacher's top-k group, which was "
                             "not given")
        for f in fields(self):
            if f.name == "valid":
                continue
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name in TOPK_FIELDS:
                self._check_topk(f.name, value)
            elif f.name == "response_ids":
                if not isinstance(value, torch.Tensor) or value.dtype == torch.bool or (
                        value.is_floating_point() or value.is_complex()):
                    got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
                    raise ValueError(f"response_ids must be an integer tensor [B, T], got {got}")
                check_same_shape(f.name, value, valid.shape, "valid")
            else:
                check_float_tensor(f.name, value)
                check_same_shape(f.name, value, valid.shape, "valid")
            if value.device != valid.device:
                raise ValueError(f"{f.name} is on {value.device} but valid is on {valid.device}")
            setattr(self, f.name, self._sanitize(f.name, value))

    def _check_topk(self, name: str, value: torch.Tensor) -> None:
        """A ``[B, T, K]`` field: ids an integer tensor of distinct ids >= 0 at valid positions,
        log-probs float; K the same within the field's group."""
        if name in _ID_FIELDS:
            if not isinstance(value, torch.Tensor) or value.dtype == torch.bool or (
                    value.is_floating_point() or value.is_complex()):
                got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"{name} must be an integer (int64) tensor [B, T, K], got {got}")
        else:
            check_float_tensor(name, value)
        b, t = self.valid.shape
        if value.dim() != 3 or tuple(value.shape[:2]) != (b, t) or value.shape[2] < 1:
            raise ValueError(f"{name} must have shape [B, T, K] = [{b}, {t}, K >= 1] (B, T of "
                             f"valid), got {tuple(value.shape)}")
        ids_name = name.split("_lp_")[0] + "_ids" if "_lp_" in name else name
        ids = getattr(self, ids_name)
        if ids.shape[2] != value.shape[2]:
            raise ValueError(f"{name} has K = {value.shape[2]} but {ids_name} has K = "
                             f"{ids.shape[2]}")
        if name in _ID_FIELDS:
            valid_ids = value[self.valid]  # [N, K]
            if bool((valid_ids < 0).any()):
                raise ValueError(f"{name} holds negative token ids at valid positions")
            ordered = valid_ids.sort(dim=-1).values
            if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
                raise ValueError(f"{name} repeats a token id within one position: the ids of a "
                                 "top-k list must be distinct")

    def _sanitize(self, name: str, value: torch.Tensor) -> torch.Tensor:
        valid = self.valid if value.dim() == 2 else self.valid[..., None]
        if name in _ID_FIELDS:
            return torch.where(valid, value.long(), torch.zeros((), dtype=torch.long,
                                                                device=value.device))
        value = value.float()
        bad = torch.isnan(value) & valid
        if name in _NONNEG_FIELDS:
            bad |= torch.isinf(value) & valid
        if bool(bad.any()):
            first = ", ".join(str(int(i)) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name} has {int(bad.sum())} NaN/inf value(s) at valid positions "
                f"(first at [{first}])"
            )
        if name in _LOGPROB_FIELDS:
            if bool(((value > 1e-3) & valid).any()):
                raise ValueError(f"{name} holds values > 0: log-probabilities must be <= 0")
            value = value.clamp(min=LOGPROB_FLOOR, max=0.0)
        return torch.where(valid, value, torch.zeros((), dtype=value.dtype,
                                                     device=value.device))

    # ---- derived signals (all stop-gradient, float32, 0 at invalid positions) -------------
    @property
    def has_residual(self) -> bool:
        return self.lp_student_res is not None

    @property
    def num_valid(self) -> int:
        return int(self.valid.sum())

    @property
    def a_full(self) -> torch.Tensor:
        """A_t^full = lpS - lpT (Eq. 12), detached. [B, T]."""
        return self.lp_student.detach() - self.lp_teacher

    @property
    def a_res(self) -> torch.Tensor:
        """A_t^res = lpS_res - lpT_res (Eq. 13). [B, T]. Requires the residual pass."""
        self.require("a_res", "lp_student_res", "lp_teacher_res")
        assert self.lp_student_res is not None and self.lp_teacher_res is not None
        return self.lp_student_res - self.lp_teacher_res

    @property
    def grounding_gap(self) -> torch.Tensor:
        """Delta_t^IG = |A_full - A_res| (Eq. 14). [B, T]."""
        return (self.a_full - self.a_res).abs()

    def top_k(self, group: str) -> int:
        """K of a top-k group, ``"teacher"`` or ``"student"`` (0 when the group is absent)."""
        ids = {"teacher": self.teacher_topk_ids, "student": self.student_topk_ids}[group]
        return 0 if ids is None else int(ids.shape[2])

    def require(self, user: str, *names: str) -> None:
        """Raise a ``ValueError`` naming ``user`` and the missing fields it needs."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(
                f"{user} needs TokenSignals field(s) {missing}, which were not computed"
            )
