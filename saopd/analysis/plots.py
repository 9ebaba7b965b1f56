"""Figures of the paper's analyses: training dynamics (Figure 4), entropy of filtered tokens
(Figure 3b), and a metric over steps per method, mean and 95% band over seeds (the held-out
accuracy over training: :func:`over_steps_figure`).

Every function returns a ``matplotlib.figure.Figure`` built without pyplot (no global state,
no GUI backend needed: headless CI renders with Agg); :func:`save_figure` writes it as PNG, and a
notebook shows it by leaving it as a cell's value.

Inputs are pandas frames: metric histories in long format (``run_id``, ``key``, ``step``,
``value``; :func:`saopd.analysis.collect.metric_histories`) and per-token frames
(:func:`saopd.analysis.token_stats.token_frame`).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

__all__ = [
    "ENTROPY_METRICS",
    "FLMR_METRIC",
    "LOSS_METRIC",
    "entropy_distribution_figure",
    "entropy_over_steps_figure",
    "figure_png",
    "loss_change",
    "over_steps_figure",
    "save_figure",
    "training_dynamics_figure",
]

LOSS_METRIC = "train/loss"
FLMR_METRIC = "train/flmr"
ENTROPY_METRICS = ("train/entropy_student_filtered", "train/entropy_student_kept")
"""Per-step mean student entropy H_S over the filtered set F and over the kept tokens V \\ F.
Training logs them when the step computes H_S (docs/reports.md)."""


def save_figure(fig: Figure, path: str | Path, *, dpi: int = 150) -> Path:
    """Write ``fig`` as PNG (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, format="png", bbox_inches="tight")
    return path


def figure_png(fig: Figure, *, dpi: int = 110) -> bytes:
    """``fig`` as PNG bytes (for ``IPython.display.Image`` whatever matplotlib backend is set)."""
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png", bbox_inches="tight")
    return buf.getvalue()


def _series(histories: pd.DataFrame, run_id: str, key: str) -> pd.Series:
    h = histories[(histories["run_id"] == run_id) & (histories["key"] == key)]
    return h.set_index("step")["value"].sort_index()


def _require(histories: pd.DataFrame, keys: Sequence[str], what: str) -> None:
    need = {"run_id", "key", "step", "value"}
    if not need <= set(histories.columns):
        raise ValueError(f"metric histories need columns {sorted(need)}, got "
                         f"{sorted(histories.columns)}")
    have = set(histories["key"])
    missing = [k for k in keys if k not in have]
    if missing:
        raise ValueError(f"{what}: no run logged {', '.join(missing)}")


def loss_change(loss: pd.Series) -> pd.Series:
    """|L_t - L_{t-1}| of a loss history indexed by step (the first step has none)."""
    return loss.sort_index().diff().abs().dropna()


def _smooth(values: pd.Series, window: int) -> pd.Series:
    return values if window <= 1 else values.rolling(window, min_periods=1).mean()


def _run_label(labels: Mapping[str, str] | None, run_id: str) -> str:
    return labels.get(run_id, run_id[:8]) if labels else run_id[:8]


_LINESTYLES = ("-", "--", ":", "-.")


def _run_styles(histories: pd.DataFrame, labels: Mapping[str, str] | None,
                groups: Mapping[str, str] | None) -> list[tuple[str, dict[str, str]]]:
    """Runs in legend order (the order of ``labels``, then the rest) with their line styles:
    one colour per group (default: per run), line styles cycling within a group."""
    present = list(dict.fromkeys(histories["run_id"]))
    order = [r for r in (labels or {}) if r in present]
    order += [r for r in present if r not in order]
    colours: dict[str, str] = {}
    seen: dict[str, int] = {}
    out = []
    for run_id in order:
        group = (groups or {}).get(run_id, run_id)
        colours.setdefault(group, f"C{len(colours) % 10}")
        n = seen[group] = seen.get(group, -1) + 1
        out.append((run_id, {"color": colours[group],
                             "linestyle": _LINESTYLES[n % len(_LINESTYLES)]}))
    return out


def training_dynamics_figure(histories: pd.DataFrame, labels: Mapping[str, str] | None = None,
                             *, groups: Mapping[str, str] | None = None, smooth: int = 1,
                             title: str | None = None) -> Figure:
    """Figure 4: per run, the absolute change of the distillation loss between consecutive
    steps, |L_t - L_{t-1}| (``train/loss``), and FLMR (Eq. 17, ``train/flmr``) over steps.

    Args:
        histories: long metric histories holding ``train/loss`` and ``train/flmr``.
        labels: legend label per run id (default: the id's first 8 characters); its order is
            the legend's.
        groups: a group per run id (e.g. its method): runs of a group share a colour and differ
            in line style (seeds); default: a colour per run.
        smooth: trailing moving-average window (steps) applied to both curves (1: none).
        title: figure title.

    Raises ``ValueError`` naming the metric when no run logged one of them.
    """
    _require(histories, (LOSS_METRIC, FLMR_METRIC), "training dynamics")
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    ax_loss, ax_flmr = fig.subplots(1, 2)
    for run_id, style in _run_styles(histories, labels, groups):
        label = _run_label(labels, run_id)
        change = loss_change(_series(histories, run_id, LOSS_METRIC))
        # short runs: mark the points, or a one-point curve would not show at all
        if len(change):
            ax_loss.plot(change.index, _smooth(change, smooth), label=label, lw=1.4,
                         marker="o" if len(change) < 20 else None, ms=3, **style)
        flmr = _series(histories, run_id, FLMR_METRIC)
        if len(flmr):
            ax_flmr.plot(flmr.index, _smooth(flmr, smooth), label=label, lw=1.4,
                         marker="o" if len(flmr) < 20 else None, ms=3, **style)
    ax_loss.set(xlabel="step", ylabel="|ΔL| (distillation loss change)",
                title="Distillation-loss change")
    ax_flmr.set(xlabel="step", ylabel="FLMR", title="Filtered loss-mass ratio")
    for ax in (ax_loss, ax_flmr):
        ax.grid(alpha=0.3)
    handles, names = ax_flmr.get_legend_handles_labels()
    if not handles:
        handles, names = ax_loss.get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, loc="outside right upper", fontsize="small")
    if title:
        fig.suptitle(title)
    return fig


def entropy_distribution_figure(tokens: pd.DataFrame, *, bins: int = 40,
                                title: str | None = None) -> Figure:
    """Figure 3b: the distribution of the student entropy H_S over filtered vs kept tokens.

    Args:
        tokens: one row per token with ``entropy_student`` (nats) and ``filtered`` (bool),
            e.g. :func:`saopd.analysis.token_stats.token_frame` of token records.
        bins: histogram bins (shared by both groups); each histogram is a density.
        title: axes title.

    Raises ``ValueError`` when there is no entropy or no filtered/kept token to compare.
    """
    if "entropy_student" not in tokens.columns or tokens["entropy_student"].isna().all():
        raise ValueError("entropy distribution: the tokens carry no student entropy "
                         "(entropy_student); the training step must compute H_S "
                         "(see docs/reports.md)")
    data = tokens.dropna(subset=["entropy_student"])
    filtered = data.loc[data["filtered"].astype(bool), "entropy_student"].to_numpy(float)
    kept = data.loc[~data["filtered"].astype(bool), "entropy_student"].to_numpy(float)
    if not len(filtered) or not len(kept):
        raise ValueError(f"entropy distribution: {len(filtered)} filtered and {len(kept)} kept "
                         "tokens; both groups are needed")
    lo, hi = float(min(filtered.min(), kept.min())), float(max(filtered.max(), kept.max()))
    edges = np.linspace(lo, hi if hi > lo else lo + 1.0, bins + 1)
    fig = Figure(figsize=(5.5, 3.6), layout="constrained")
    ax = fig.subplots()
    ax.hist(kept, bins=edges, density=True, alpha=0.55, color="#4c72b0",
            label=f"kept (n={len(kept)}, mean {kept.mean():.2f})")
    ax.hist(filtered, bins=edges, density=True, alpha=0.65, color="#c44e52",
            label=f"filtered (n={len(filtered)}, mean {filtered.mean():.2f})")
    ax.set(xlabel="student entropy H_S (nats)", ylabel="density",
           title=title or "Entropy of filtered vs kept tokens")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return fig


def entropy_over_steps_figure(histories: pd.DataFrame, labels: Mapping[str, str] | None = None,
                              *, title: str | None = None) -> Figure:
    """Mean student entropy of filtered (dashed) vs kept (solid) tokens per step, per run,
    from the metrics :data:`ENTROPY_METRICS`.

    Raises ``ValueError`` naming the metrics when no run logged them.
    """
    _require(histories, ENTROPY_METRICS, "entropy over steps")
    fig = Figure(figsize=(6.5, 3.6), layout="constrained")
    ax = fig.subplots()
    for i, (run_id, _) in enumerate(_run_styles(histories, labels, None)):
        label = _run_label(labels, run_id)
        for key, style, part in ((ENTROPY_METRICS[1], "-", "kept"),
                                 (ENTROPY_METRICS[0], "--", "filtered")):
            s = _series(histories, run_id, key)
            if len(s):
                ax.plot(s.index, s.values, style, color=f"C{i % 10}", lw=1.4,
                        label=f"{label}: {part}")
    ax.set(xlabel="step", ylabel="mean H_S (nats)",
           title=title or "Student entropy: filtered vs kept")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return fig


def over_steps_figure(histories: pd.DataFrame, groups: Mapping[str, str],
                      panels: Sequence[tuple[str, str]], *, order: Sequence[str] | None = None,
                      eval_steps: bool = True, title: str | None = None) -> Figure:
    """One panel per ``(metric, title)`` of ``panels``: per method (``groups``: run id ->
    label, its seeds the runs of one label) the mean over its runs at each step and the 95%
    confidence band of that mean (Student's t, :func:`saopd.analysis.tables.mean_ci95`; no band
    where one run has the step). The legend names each method with its seed count.

    Args:
        histories: long metric histories (:func:`saopd.analysis.collect.metric_histories`).
        groups: the method of each run to draw; other runs are left out.
        panels: metrics and panel titles, e.g. ``[("eval/arith/avg_at_4", "held-out
            accuracy (Avg@4)")]``.
        order: methods in legend order (default: first seen in ``groups``).
        eval_steps: the metrics are evaluations, logged at the index of the step just taken
            (-1: before training): drawn at ``index + 1`` = steps trained.
        title: figure title.

    Raises ``ValueError`` naming a metric no run logged.
    """
    from saopd.analysis.tables import mean_ci95

    _require(histories, [m for m, _ in panels], "over steps")
    labels = list(order or dict.fromkeys(groups.values()))
    fig = Figure(figsize=(5.2 * len(panels) + 2.2, 3.8), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(panels)))
    for ax, (metric, panel_title) in zip(axes, panels, strict=True):
        h = histories[histories["key"] == metric]
        for i, label in enumerate(labels):
            runs = [r for r, lab in groups.items() if lab == label]
            pts = h[h["run_id"].isin(runs)]
            if pts.empty:
                continue
            steps = sorted(pts["step"].unique())
            stats = [mean_ci95(list(pts.loc[pts["step"] == s, "value"])) for s in steps]
            x = np.asarray(steps, dtype=float) + (1.0 if eval_steps else 0.0)
            mean = np.asarray([m for m, _ in stats])
            half = np.nan_to_num(np.asarray([w for _, w in stats]), nan=0.0)
            seeds = pts["run_id"].nunique()
            ax.plot(x, mean, color=f"C{i % 10}", lw=1.5, marker="o" if len(x) < 20 else None,
                    ms=3, label=f"{label} (n={seeds})")
            ax.fill_between(x, mean - half, mean + half, color=f"C{i % 10}", alpha=0.15,
                            lw=0)
        ax.set(xlabel="steps trained" if eval_steps else "step", ylabel=metric,
               title=panel_title)
        ax.grid(alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, loc="outside right upper", fontsize="small",
                   title="mean, 95% band over seeds", title_fontsize="small")
    if title:
        fig.suptitle(title)
    return fig
