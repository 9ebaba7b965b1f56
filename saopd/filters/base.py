"""The filter interface: ``TokenFilter(signals) -> FilterResult``, one registry for all variants.

A filter decides which valid tokens carry OPD loss. SA-OPD removes the set F of Eq. 16 and
optimises only V \\ F (Eq. 19); baselines keep or re-weight tokens by their own scores. Every
filter returns the same :class:`FilterResult`, whose statistics (FLMR, filtered share, ...) are
computed by one function, :func:`filter_stats`, so they mean the same thing for every method.

Masks: ``keep`` is True where a token is valid AND carries loss; ``filtered = valid & ~keep``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from saopd.registry import Registry
from saopd.signals.token_signals import TokenSignals

FLMR_EPS: float = 1e-8
"""epsilon of Eq. 17: FLMR = sum_F |A| / (sum_V |A| + eps)."""


@dataclass
class FilterResult:
    """What a filter decided for one batch.

    Attributes:
        keep: bool [B, T], True = valid token that carries loss (V \\ F).
        filtered: bool [B, T], True = valid token removed from the loss (the set F);
            ``keep | filtered == valid`` and the two never overlap.
        weights: float32 [B, T], per-token loss weight; 0 wherever ``keep`` is False, 1 for
            plain filters, method-specific for re-weighting baselines (FiRe-OPD).
        stats: python floats for logging; see :func:`filter_stats` for the keys.
    """

    keep: torch.Tensor
    filtered: torch.Tensor
    weights: torch.Tensor
    stats: dict[str, float] = field(default_factory=dict)

    def rows(self, rows: slice) -> FilterResult:
        """The decision for batch rows ``rows`` (a micro-batch); ``stats`` stay the whole
        batch's."""
        return FilterResult(keep=self.keep[rows], filtered=self.filtered[rows],
                            weights=self.weights[rows], stats=self.stats)


def _mean_over(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of ``values`` over ``mask``; 0.0 for an empty mask (the matching count says so)."""
    n = int(mask.sum())
    return float(values[mask].sum()) / n if n else 0.0


def check_finite_at(name: str, values: torch.Tensor, valid: torch.Tensor) -> None:
    """Refuse NaN or +-inf in ``values`` at ``valid`` positions (same shape; bool ``valid``).

    A filter's ranks and FLMR are meaningless with a non-finite score: +inf in A would make
    FLMR NaN and silently skip the bound of Algorithm 2. :class:`TokenSignals` clamps log-probs
    at its floor, so training never gets here; callers of the public functions might.

    Raises:
        ValueError: naming ``name``, how many values are bad and the first bad position.
    """
    bad = ~torch.isfinite(values.detach()) & valid
    if bool(bad.any()):
        first = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(
            f"{name} has {int(bad.sum())} non-finite value(s) (NaN or inf) at valid positions, "
            f"first at {first} (value {float(values.detach()[tuple(first)])}); the filters "
            "need finite scores (TokenSignals clamps log-probs at LOGPROB_FLOOR)")


def filtered_loss_mass_ratio(a_full: torch.Tensor, filtered: torch.Tensor,
                             valid: torch.Tensor) -> float:
    """FLMR of Eq. 17: sum_{t in F} |A_t| / (sum_{t in V} |A_t| + eps).

    Args: ``a_full`` float [B, T] (or [N]), ``filtered`` bool (True = in F, subset of V),
    ``valid`` bool (True = in V), all of one shape; ``a_full`` finite at valid positions
    (``ValueError`` otherwise).
    """
    check_finite_at("a_full", a_full, valid)
    abs_a = a_full.detach().float().abs()
    # float64 accumulation, as in SA-OPD's alpha search, so bound checks agree to ~1e-15
    in_f = abs_a[filtered & valid].sum(dtype=torch.float64)
    return float(in_f) / (float(abs_a[valid].sum(dtype=torch.float64)) + FLMR_EPS)


def scatter_valid(compact: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Place a compact [N] tensor (row-major order of the valid tokens) back into [B, T].

    Invalid positions get False / 0. Inverse of ``x[valid]``.
    """
    if compact.numel() == valid.numel():  # every token valid: a reshape is the inverse
        return compact.reshape(valid.shape).clone()
    out = torch.zeros(valid.shape, dtype=compact.dtype, device=compact.device)
    return out.masked_scatter_(valid, compact)


def filter_stats(signals: TokenSignals, filtered: torch.Tensor, *, alpha: float = 1.0,
                 p1: float | None = None, p2: float | None = None) -> dict[str, float]:
    """Statistics of a filtered set F (bool [B, T], subset of ``signals.valid``).

    Keys:
        flmr: filtered loss-mass ratio, Eq. 17: sum_F |A_full| / (sum_V |A_full| + eps).
        filtered_ratio: |F| / |V| (0 when there is no valid token).
        n_valid, n_filtered: |V| and |F|.
        abs_a_filtered, abs_a_kept: mean |A_full| over F and over V \\ F.
        grounding_gap_filtered, grounding_gap_kept: mean Delta^IG over F and V \\ F (only when
            the residual signals exist).
        entropy_student_filtered, entropy_student_kept: mean student entropy H_S over F and
            V \\ F (only when the step computed H_S; the paper's Figure 3b).
        alpha, p1, p2: the adaptive scale and effective ratios (when the filter has them).
    Means over an empty set are reported as 0.0; the counts tell them apart.
    """
    valid = signals.valid
    kept = valid & ~filtered
    abs_a = signals.a_full.abs()  # [B, T], 0 at invalid positions
    n_valid = int(valid.sum())
    n_filtered = int(filtered.sum())
    stats = {
        "flmr": filtered_loss_mass_ratio(signals.a_full, filtered, valid),
        "filtered_ratio": n_filtered / n_valid if n_valid else 0.0,
        "n_valid": float(n_valid),
        "n_filtered": float(n_filtered),
        "abs_a_filtered": _mean_over(abs_a, filtered),
        "abs_a_kept": _mean_over(abs_a, kept),
        "alpha": float(alpha),
    }
    if signals.has_residual:
        gap = signals.grounding_gap
        stats["grounding_gap_filtered"] = _mean_over(gap, filtered)
        stats["grounding_gap_kept"] = _mean_over(gap, kept)
    if signals.entropy_student is not None:
        entropy = signals.entropy_student.detach()
        stats["entropy_student_filtered"] = _mean_over(entropy, filtered)
        stats["entropy_student_kept"] = _mean_over(entropy, kept)
    if p1 is not None:
        stats["p1"] = float(p1)
    if p2 is not None:
        stats["p2"] = float(p2)
    return stats


class TokenFilter:
    """Base of every filter: a dataclass whose fields are its hyperparameters.

    Subclasses implement :meth:`apply`, returning a :class:`FilterResult` (most build it from
    the filtered set F, bool [B, T], with :func:`result_from_filtered`); :meth:`__call__` checks
    that the signals hold what :attr:`needs` lists, then calls :meth:`apply`. Every entry of
    ``FilterResult.stats`` is logged (``train/<key>``).
    ``needs`` lists the :class:`TokenSignals` fields the filter reads beyond lpS, lpT, valid, so
    the training step computes only those (vanilla OPD pays for no residual pass).

    ``label`` is the filter's name in the paper's tables (``saopd-report``'s rows; None: the
    config name); ``table_order`` its row's place among the methods (lower first; None: after
    the ordered ones, by label). Both are read from the registered class itself, not inherited:
    a subclass registered under another name is its own row.
    """

    name: ClassVar[str]
    requires: ClassVar[tuple[str, ...]] = ()
    label: ClassVar[str | None] = None
    table_order: ClassVar[int | None] = None

    @property
    def needs(self) -> tuple[str, ...]:
        return self.requires

    def bind_tokenizer(self, tokenizer: object) -> None:
        """Resolve what the filter names by text to the tokenizer's ids; called once by the
        training module before the first step. Most filters name no tokens: a no-op."""

    def __call__(self, signals: TokenSignals, *,
                 generator: torch.Generator | None = None) -> FilterResult:
        signals.require(f"filter {self.name!r}", *self.needs)
        return self.apply(signals, generator=generator)

    def apply(self, signals: TokenSignals, *,
              generator: torch.Generator | None = None) -> FilterResult:
        """Decide F for the batch (``generator``: the step's seeded RNG, for random filters)."""
        raise NotImplementedError


def result_from_filtered(signals: TokenSignals, filtered: torch.Tensor,
                         **stats_kwargs: float | None) -> FilterResult:
    """Pack a filtered set F into a FilterResult with unit weights on V \\ F."""
    filtered = filtered & signals.valid
    keep = signals.valid & ~filtered
    return FilterResult(keep=keep, filtered=filtered, weights=keep.float(),
                        stats=filter_stats(signals, filtered, **stats_kwargs))


#: Every registered class, by config name: ``FILTERS.build(name, **params)`` or
#: ``FILTERS.from_config(mapping)`` instantiates one (unknown names or keys raise ``ValueError``).
FILTERS: Registry[TokenFilter] = Registry("filter")
