"""Paper-style results tables (Tables 1-3) from per-run scores, as Markdown, LaTeX and HTML.

Rows are methods (vanilla OPD first, SA-OPD last, as in the paper), optionally preceded by
reference rows (Student, Teacher) that are shown but not ranked. Columns are benchmarks, then
``Avg.`` (the mean over the table's benchmarks) and ``Δ OPD`` (the row's ``Avg.`` minus vanilla
OPD's). A paper-style ``Δ over OPD`` row (per benchmark) follows the highlighted method
(SA-OPD by default).

Seeds. Runs of one method are its seeds: a cell shows their mean, and ``± spread`` when there
are at least two: the sample standard deviation (``spread="std"``, ddof = 1) or the half-width
of the 95% confidence interval of the mean, t(0.975, n-1) * std / sqrt(n) (``spread="ci95"``).
``Avg.`` is computed per run first (mean over the benchmarks), then its mean and spread over the
seeds; a run that lacks one of the benchmarks has no ``Avg.``, and its method's ``Avg.`` is left
empty (a note names the run and the missing benchmarks). ``Δ`` values are differences of means.

Marks. Among method rows (references and Δ rows excluded), per column (benchmarks and
``Avg.``), ``marking="interval"`` (what ``saopd-report`` uses) bolds a method only where its 95%
interval over seeds lies above every other method's: overlapping intervals (or a single seed)
mark nothing, so a tie is never called a win. ``marking="rank"`` bolds the best displayed value
and underlines the second (ties share a mark, as in the paper). The t quantile is
``scipy.stats.t.ppf``; ``decimals=None`` rounds to the intervals (:func:`auto_decimals`: two
significant digits of the smallest half-width).

Scores are the fractions that ``saopd-eval`` logs, multiplied by ``scale`` (100: percent).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pandas as pd

from saopd.analysis.collect import BASELINE_LABEL, method_order
from saopd.analysis.grid import Cell, Grid, grid_html, grid_latex, grid_markdown

__all__ = [
    "AVG",
    "GAIN",
    "ResultsTable",
    "auto_decimals",
    "fieller_ratio_ci95",
    "mean_ci95",
    "missing_notes",
    "paired_recovery",
    "results_table",
    "t_quantile_975",
]

AVG = "Avg."
GAIN = "Δ OPD"
Spread = Literal["std", "ci95"]

Marking = Literal["rank", "interval"]


def t_quantile_975(df: int) -> float:
    """Student's t quantile t(0.975, df) (two-sided 95%), ``scipy.stats.t.ppf``."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    from scipy.stats import t

    return float(t.ppf(0.975, df))


def auto_decimals(half_widths: Any, *, fallback: int = 1) -> int:
    """Digits after the point that show a 95% half-width with two significant digits (the
    smallest positive one of ``half_widths``; 0 to 4 digits): 2.9 -> 1, 0.25 -> 2, 14 -> 0.
    ``fallback`` when there is none (single seeds)."""
    vals = [float(v) for v in pd.Series(half_widths, dtype=float).dropna() if float(v) > 0]
    if not vals:
        return fallback
    return max(0, min(4, 1 - math.floor(math.log10(min(vals)))))


def mean_ci95(values: Sequence[float]) -> tuple[float, float]:
    """The mean of ``values`` (NaN entries dropped) and the half-width of its 95% confidence
    interval, t(0.975, n-1) * std / sqrt(n) (sample std, ddof = 1); NaN where undefined (no
    value; one value has a mean but no interval)."""
    vals = [float(v) for v in values if not math.isnan(float(v))]
    if not vals:
        return float("nan"), float("nan")
    mean = sum(vals) / len(vals)
    if len(vals) < 2:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return mean, t_quantile_975(len(vals) - 1) * math.sqrt(var / len(vals))


def fieller_ratio_ci95(num: Sequence[float], den: Sequence[float]
                       ) -> tuple[float, float, float]:
    """A ratio of paired means, mean(num) / mean(den), with Fieller's 95% interval.

    ``num[i]`` and ``den[i]`` come from the same seed i (e.g. a method's and the control's
    accuracy gain over a common baseline), so their covariance enters the interval: the set of
    ratios q with (mean(num) - q mean(den))^2 <= t^2 var(num - q den) / n, t = t(0.975, n - 1).
    Unlike dividing the numerator's interval by mean(den), this counts the denominator's own
    uncertainty (a harm measured over the same few seeds). Pairs with a NaN are dropped.

    Returns ``(ratio, low, high)``; low and high are -inf / +inf when the denominator's own
    interval includes zero (the ratio is then unbounded at 95%), NaN with fewer than 2 pairs.
    """
    pairs = [(float(a), float(b)) for a, b in zip(num, den, strict=True)
             if not (math.isnan(float(a)) or math.isnan(float(b)))]
    n = len(pairs)
    nan = float("nan")
    if n == 0:
        return nan, nan, nan
    mx = sum(a for a, _ in pairs) / n
    my = sum(b for _, b in pairs) / n
    ratio = mx / my if my != 0 else nan
    if n < 2:
        return ratio, nan, nan
    sxx = sum((a - mx) ** 2 for a, _ in pairs) / (n - 1) / n
    syy = sum((b - my) ** 2 for _, b in pairs) / (n - 1) / n
    sxy = sum((a - mx) * (b - my) for a, b in pairs) / (n - 1) / n
    t2 = t_quantile_975(n - 1) ** 2
    qa = my * my - t2 * syy
    qb = -2.0 * (mx * my - t2 * sxy)
    qc = mx * mx - t2 * sxx
    disc = qb * qb - 4.0 * qa * qc
    if qa <= 0 or disc < 0:
        return ratio, float("-inf"), float("inf")
    root = math.sqrt(disc)
    return ratio, (-qb - root) / (2.0 * qa), (-qb + root) / (2.0 * qa)


def paired_recovery(scores: Mapping[str, Mapping[str, float]], *, base: str, control: str
                    ) -> dict[str, dict[str, Any]]:
    """Each method's paired difference to ``base`` and the share of a harm it recovers.

    ``scores``: label -> seed -> score (e.g. final accuracy). The **harm** is
    ``control - base`` paired over the seeds both have (e.g. OPD from a clean teacher minus OPD
    from a teacher with a harmful prior); a NaN score (an evaluation that logged NaN) is no
    score, so its seed is not paired. For each label: ``pairs`` (seeds shared with ``base``),
    ``diff`` = [mean, 95% half-width] of ``label - base`` over those seeds, ``recovered`` =
    ``diff`` divided by the harm's mean (the share of the harm the method recovers: 0 = none,
    1 = all, the interval scaled likewise, so it ignores the harm's own uncertainty), ``harm``
    = [mean, half-width]. Undefined values are NaN (no shared seed, a zero or undefined harm).

    Raises:
        KeyError: ``base`` is not a label of ``scores``.
    """
    base_scores = scores[base]

    def paired(mine: Mapping[str, float]) -> list[str]:
        """The seeds both have a score for (a NaN score is none: it pairs with nothing)."""
        return [s for s in base_scores if s in mine
                and not math.isnan(float(mine[s])) and not math.isnan(float(base_scores[s]))]

    shared = paired(scores.get(control, {}))
    harm = mean_ci95([scores[control][s] - base_scores[s] for s in shared])
    out: dict[str, dict[str, Any]] = {}
    for label, mine in scores.items():
        pairs = paired(mine)
        diff = mean_ci95([mine[s] - base_scores[s] for s in pairs])
        defined = bool(shared) and not math.isnan(harm[0]) and harm[0] != 0.0
        recovered = ([diff[0] / harm[0], diff[1] / abs(harm[0])] if defined
                     else [float("nan"), float("nan")])
        out[label] = {"pairs": len(pairs), "diff": list(diff), "recovered": recovered,
                      "harm": list(harm)}
    return out


# ---- the results table ---------------------------------------------------------------------------

@dataclass
class ResultsTable:
    """Seed-aggregated scores of methods (and reference rows) on benchmarks.

    Attributes:
        mean: index = row labels (references, then methods in table order), columns = the
            benchmark columns (their header labels) then :data:`AVG`; scaled scores.
        spread: same shape; std or 95% CI half-width over seeds (NaN with fewer than 2 runs).
        ci: same shape; the 95% CI half-width over seeds whatever ``spread`` shows (the
            interval marks compare).
        n: runs (seeds) behind each row: those with a value in every column (behind ``Avg.``).
        gain: ``Avg.`` minus the baseline's ``Avg.`` (NaN for the baseline, or without one).
        delta: per-column difference highlight - baseline (the ``Δ over OPD`` row), or None.
        references, methods: row labels by kind, in table order.
        baseline, highlight: the baseline and highlighted method labels (``None`` if absent).
        spread_kind: ``"std"`` or ``"ci95"``.
        decimals: digits shown after the point.
        notes: what the reader must know (missing benchmarks, dropped rows).
        caption: the table caption.
    """

    mean: pd.DataFrame
    spread: pd.DataFrame
    n: pd.Series
    gain: pd.Series
    delta: pd.Series | None
    references: list[str]
    methods: list[str]
    baseline: str | None
    highlight: str | None
    spread_kind: Spread = "std"
    decimals: int = 1
    notes: list[str] = field(default_factory=list)
    caption: str | None = None
    ci: pd.DataFrame | None = None
    marking: Marking = "rank"

    @property
    def columns(self) -> list[str]:
        """The ranked columns: benchmarks and ``Avg.``."""
        return list(self.mean.columns)

    def marks(self) -> pd.DataFrame:
        """``best`` / ``second`` / ``""`` per method row and column (references excluded).

        ``marking="rank"``: the best and second-best displayed values (ties share a mark).
        ``marking="interval"``: ``best`` only for the method whose 95% interval lies above
        every other method's (its lower end above their upper ends); none where intervals
        overlap, or a method has no interval (one seed); no ``second``."""
        out = pd.DataFrame("", index=self.methods, columns=self.columns, dtype=object)
        if self.marking == "interval":
            ci = self.ci if self.ci is not None else self.spread
            for col in self.columns:
                mean = self.mean.loc[self.methods, col].dropna()
                if len(mean) < 2:
                    continue
                half = ci.loc[mean.index, col]
                top = mean.idxmax()
                others = mean.index != top
                if half.isna().any():
                    continue
                if (mean[top] - half[top]) > (mean[others] + half[others]).max():
                    out.at[top, col] = "best"
            return out
        for col in self.columns:
            shown = self.mean.loc[self.methods, col].round(self.decimals).dropna()
            levels = sorted(set(shown), reverse=True)
            for row, value in shown.items():
                if value == levels[0]:
                    out.at[row, col] = "best"
                elif len(levels) > 1 and value == levels[1]:
                    out.at[row, col] = "second"
        return out

    def _fmt(self, value: float, *, signed: bool = False) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "–"
        text = f"{value:+.{self.decimals}f}" if signed else f"{value:.{self.decimals}f}"
        return text

    def grid(self) -> Grid:
        """The table as a :class:`Grid` (what the ``to_*`` methods render)."""
        marks = self.marks()
        with_spread = bool((self.n > 1).any())
        header = ["Method", *self.columns]
        if self.baseline is not None:
            header.append(GAIN)
        if with_spread:
            header.append("Seeds")
        rows: list[list[Cell]] = []
        classes: list[str] = []
        rules: set[int] = set()

        def value_row(label: str, kind: str) -> None:
            cells = [Cell(label)]
            for col in self.columns:
                v = self.mean.at[label, col]
                text = self._fmt(v)
                s = self.spread.at[label, col]
                if text != "–" and not pd.isna(s):
                    text += f" ± {s:.{self.decimals}f}"
                mark = marks.at[label, col] if label in marks.index else ""
                cells.append(Cell(text, mark))  # type: ignore[arg-type]
            if self.baseline is not None:
                cells.append(Cell("–" if label == self.baseline
                                  else self._fmt(self.gain.get(label), signed=True)))
            if with_spread:
                cells.append(Cell(str(int(self.n[label]))))
            rows.append(cells)
            classes.append(kind)

        for label in self.references:
            value_row(label, "reference")
        if self.references:
            rules.add(len(rows))
        for label in self.methods:
            if label == self.highlight and len(self.methods) > 1:
                rules.add(len(rows))
            value_row(label, "highlight" if label == self.highlight else "method")
            if label == self.highlight and self.delta is not None:
                cells = [Cell(f"Δ over {self.baseline}")]
                cells += [Cell(self._fmt(self.delta.get(c), signed=True)) for c in self.columns]
                if self.baseline is not None:
                    cells.append(Cell(""))
                if with_spread:
                    cells.append(Cell(""))
                rows.append(cells)
                classes.append("delta")
        notes = list(self.notes)
        if with_spread:
            what = ("sample standard deviation over seeds" if self.spread_kind == "std"
                    else "95% confidence interval of the mean over seeds (Student's t)")
            notes.insert(0, f"mean ± {what}; Seeds = runs per row.")
        if self.marking == "interval":
            notes.insert(0, "Bold: the method whose 95% interval over seeds lies above every "
                         "other method's (none where the intervals overlap).")
        else:
            notes.insert(0, "Best and second-best results among OPD methods in bold and "
                         "underlined.")
        return Grid(header=header, rows=rows, rules=rules, row_classes=classes,
                    caption=self.caption, notes=notes)

    def to_markdown(self) -> str:
        """GitHub Markdown."""
        return grid_markdown(self.grid())

    def to_latex(self, label: str | None = None) -> str:
        """A LaTeX ``table`` with booktabs rules."""
        return grid_latex(self.grid(), label=label)

    def to_html(self, *, title: str | None = None, standalone: bool = True) -> str:
        """A self-contained HTML page (or just the ``<table>``)."""
        return grid_html(self.grid(), title=title, standalone=standalone)


def missing_notes(values: pd.DataFrame, labels: pd.Series) -> list[str]:
    """One note per set of missing columns: how many of the runs lack it, which runs (label and
    id, the first 8) and what follows (no ``Avg.`` for their methods, not counted in Seeds)."""
    by_lack: dict[tuple[str, ...], list[str]] = {}
    for run_id in values.index[values.isna().any(axis=1)]:
        lacks = tuple(c for c in values.columns if pd.isna(values.at[run_id, c]))
        by_lack.setdefault(lacks, []).append(run_id)
    notes = []
    for lacks, ids in by_lack.items():
        who = [f"{labels[r].removeprefix(chr(0) + 'ref:')} ({r})" for r in ids]
        shown = ", ".join(who[:8]) + (f" and {len(who) - 8} more" if len(who) > 8 else "")
        methods = sorted({labels[r].removeprefix(chr(0) + "ref:") for r in ids})
        notes.append(f"{len(ids)} of {len(values)} runs lack {', '.join(lacks)} (not logged, "
                     f"or NaN): {shown}; no {AVG} for {', '.join(methods)}, and these runs are "
                     "not counted in Seeds.")
    return notes


def _order(labels: Sequence[str], baseline: str | None, highlight: str | None) -> list[str]:
    known_order = method_order()

    def key(label: str) -> tuple[int, int, str]:
        if label == baseline:
            return (0, 0, label)
        if label == highlight:
            return (2, 0, label)
        # a known label, or one with a variant after it ("SA-OPD (top-k KL)"); the longest
        # known label that matches, so that a label holding " (" itself keeps its own place
        matches = [i for i, k in enumerate(known_order)
                   if label == k or label.startswith(k + " (")]
        known = max(matches, key=lambda i: len(known_order[i])) if matches else len(known_order)
        return (1, known, label)

    return sorted(dict.fromkeys(labels), key=key)


def results_table(scores: pd.DataFrame, columns: Mapping[str, str], *,
                  labels: pd.Series, references: Mapping[str, Sequence[str]] | None = None,
                  baseline: str | None = BASELINE_LABEL, highlight: str | None = "SA-OPD",
                  spread: Spread = "std", scale: float = 100.0, decimals: int | None = 1,
                  caption: str | None = None, marking: Marking = "rank") -> ResultsTable:
    """Aggregate per-run scores into a :class:`ResultsTable`.

    Args:
        scores: one row per run (index = run id), one column per metric
            (``eval/<bench>/avg_at_<k>``) as fractions; NaN where a run lacks it.
        columns: ``{metric column of scores: header label}``, in table order.
        labels: method label per run (same index as ``scores``), e.g.
            :func:`saopd.analysis.collect.method_labels`.
        references: ``{row label: [run ids]}`` shown above the methods and never ranked
            (Student, Teacher); their runs are taken out of the method rows.
        baseline: the method ``Δ`` is measured against (``None`` or absent: no ``Δ``).
        highlight: the method shown last, shaded, with a ``Δ over OPD`` row (if present).
        spread: ``"std"`` or ``"ci95"`` (see the module docstring).
        scale: multiplies the scores (100: percent).
        decimals: digits after the point, for display and for tie-aware marks; None: from
            the intervals (:func:`auto_decimals`).
        caption: table caption.
        marking: ``"rank"`` (best and second-best values) or ``"interval"`` (bold only where a
            method's 95% interval separates from every other's; :meth:`ResultsTable.marks`).

    Raises ``ValueError`` on an empty score frame, an unknown metric column, or labels that do
    not cover the runs.
    """
    if scores.empty:
        raise ValueError("no runs to tabulate")
    missing_cols = [c for c in columns if c not in scores.columns]
    if missing_cols:
        raise ValueError(f"score frame lacks metric column(s) {missing_cols}")
    if spread not in ("std", "ci95"):
        raise ValueError(f"spread must be 'std' or 'ci95', got {spread!r}")
    if marking not in ("rank", "interval"):
        raise ValueError(f"marking must be 'rank' or 'interval', got {marking!r}")
    unlabelled = set(scores.index) - set(labels.index)
    if unlabelled:
        raise ValueError(f"no method label for run(s) {sorted(unlabelled)}")
    labels = labels.reindex(scores.index).astype(object)
    references = {k: list(v) for k, v in (references or {}).items()}
    for ref, ids in references.items():
        unknown = [i for i in ids if i not in scores.index]
        if unknown:
            raise ValueError(f"reference {ref!r}: run(s) {unknown} are not among the scores")
        labels.loc[ids] = f"\0ref:{ref}"

    values = scores[list(columns)].astype(float) * scale
    values.columns = list(columns.values())
    per_run_avg = values.mean(axis=1, skipna=False)
    notes: list[str] = []
    notes.extend(missing_notes(values, labels))
    values[AVG] = per_run_avg

    method_labels = [lab for lab in labels if not lab.startswith("\0ref:")]
    if baseline not in method_labels:
        if baseline is not None:
            notes.append(f"no {baseline!r} runs: no {GAIN} column.")
        baseline = None
    if highlight not in method_labels:
        highlight = None
    order = [f"\0ref:{r}" for r in references] + _order(method_labels, baseline, highlight)

    grouped = values.groupby(labels, sort=False)
    mean = grouped.mean().reindex(order)
    # a method's Avg. only when every one of its runs has every benchmark
    has_all = (~values.drop(columns=AVG).isna().any(axis=1)).groupby(labels, sort=False).all()
    mean.loc[~has_all.reindex(order, fill_value=False).astype(bool), AVG] = float("nan")
    # the runs behind each cell: a run without a value there (not logged, or NaN) is no seed
    # of it; Seeds counts the runs with every value (those behind Avg.)
    counts = values.notna().groupby(labels, sort=False).sum().reindex(order).fillna(0)
    n = counts[AVG].astype(int)
    std = grouped.std(ddof=1).reindex(order)
    factor = counts.map(lambda k: t_quantile_975(int(k) - 1) / math.sqrt(k) if k > 1
                        else float("nan"))
    ci = (std * factor).where(counts > 1)
    ci.loc[mean[AVG].isna(), AVG] = float("nan")
    sp = ci if spread == "ci95" else std.where(counts > 1)
    sp.loc[mean[AVG].isna(), AVG] = float("nan")
    if decimals is None:
        decimals = auto_decimals(ci.to_numpy().ravel())

    gain = pd.Series(float("nan"), index=order)
    delta = None
    if baseline is not None:
        gain = mean[AVG] - mean.at[baseline, AVG]
        gain[baseline] = float("nan")
        if highlight is not None and highlight != baseline:
            delta = mean.loc[highlight] - mean.loc[baseline]

    rename = {lab: lab.removeprefix("\0ref:") for lab in order}
    refs = [rename[f"\0ref:{r}"] for r in references]
    clash = set(refs) & set(method_labels)
    if clash:
        raise ValueError(f"reference row name(s) {sorted(clash)} are also method labels")
    mean, sp, ci = mean.rename(index=rename), sp.rename(index=rename), ci.rename(index=rename)
    n, gain = n.rename(index=rename), gain.rename(index=rename)
    return ResultsTable(
        mean=mean, spread=sp, n=n, gain=gain, delta=delta, references=refs,
        methods=[rename[o] for o in order if not o.startswith("\0ref:")],
        baseline=baseline, highlight=highlight, spread_kind=spread, decimals=decimals,
        notes=notes, caption=caption, ci=ci, marking=marking)
