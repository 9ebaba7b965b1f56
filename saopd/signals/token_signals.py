"""Per-token signals of one batch of student rollouts, the input of every filter and objective.

Notation follows the paper (``../shared/paper/sa-opd.tex``, Sec. 3) and ``BASELINES.md``: for each
valid response token t of a rollout y ~ pi_S(.|x),

- ``lp_student``   = log pi_S(y_t | x, y_<t)            (may carry gradient: the student full pass)
- ``lp_teacher``   = log pi_T(y_t | x, y_<t)
- ``lp_student_res`` / ``lp_teacher_res``: the same with the task input removed (residual context)
- ``a_full``  = lp_student - lp_teacher                  (Eq. 12, stop-gradient)
- ``a_res``   = lp_student_res - lp_teacher_res          (Eq. 13)
- ``grounding_gap`` = |a_full - a_res|                   (Eq. 14, the input-grounding gap)

All tensors are ``[B, T]`` over response positions; ``valid`` is a bool ``[B, T]`` mask, True
where the position holds a real response token (False = padding or prompt). Values at invalid
positions are ignored: they are replaced by 0 on construction, so padding can never change a result.

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

_LOGPROB_FIELDS = ("lp_student", "lp_teacher", "lp_student_res", "lp_teacher_res",
                   "lp_sampler", "lp_ref")
_NONNEG_FIELDS = ("entropy_student", "entropy_teacher", "kl")


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
        for f in fields(self):
            if f.name == "valid":
                continue
            value = getattr(self, f.name)
            if value is None:
                continue
            check_float_tensor(f.name, value)
            check_same_shape(f.name, value, valid.shape, "valid")
            if value.device != valid.device:
                raise ValueError(f"{f.name} is on {value.device} but valid is on {valid.device}")
            setattr(self, f.name, self._sanitize(f.name, value))

    def _sanitize(self, name: str, value: torch.Tensor) -> torch.Tensor:
        value = value.float()
        bad = torch.isnan(value) & self.valid
        if name in _NONNEG_FIELDS:
            bad |= torch.isinf(value) & self.valid
        if bool(bad.any()):
            b, t = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name} has {int(bad.sum())} NaN/inf value(s) at valid positions "
                f"(first at [{b}, {t}])"
            )
        if name in _LOGPROB_FIELDS:
            if bool(((value > 1e-3) & self.valid).any()):
                raise ValueError(f"{name} holds values > 0: log-probabilities must be <= 0")
            value = value.clamp(min=LOGPROB_FLOOR, max=0.0)
        return torch.where(self.valid, value, torch.zeros((), dtype=value.dtype,
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

    def require(self, user: str, *names: str) -> None:
        """Raise a ``ValueError`` naming ``user`` and the missing fields it needs."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(
                f"{user} needs TokenSignals field(s) {missing}, which were not computed"
            )
