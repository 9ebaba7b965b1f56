"""Results tables from per-run scores: seed means and spread, Avg., gain over OPD, marks."""

from __future__ import annotations

import math
import re
import statistics

import pandas as pd
import pytest

from saopd.analysis.tables import (
    AVG,
    GAIN,
    mean_ci95,
    paired_recovery,
    results_table,
    t_quantile_975,
)
from tests.analysis.rendered import html_rows, md_rows

M1, M2 = "eval/math500/avg_at_1", "eval/aime24/avg_at_8"
COLUMNS = {M1: "Math500", M2: "AIME24"}
# run -> (method, math500, aime24), fractions
RUNS = {
    "o0": ("OPD", 0.60, 0.10), "o1": ("OPD", 0.62, 0.12), "o2": ("OPD", 0.64, 0.08),
    "s0": ("SA-OPD", 0.66, 0.12), "s1": ("SA-OPD", 0.68, 0.14), "s2": ("SA-OPD", 0.71, 0.13),
    "e0": ("ExOPD", 0.65, 0.14),
    "t0": ("TIP", 0.68, 0.13),
    "st": ("student", 0.30, 0.01),
}


def _frames(runs: dict = RUNS) -> tuple[pd.DataFrame, pd.Series]:
    scores = pd.DataFrame({M1: {r: v[1] for r, v in runs.items()},
                           M2: {r: v[2] for r, v in runs.items()}})
    labels = pd.Series({r: v[0] for r, v in runs.items()})
    return scores, labels


def _values(method: str, col: int) -> list[float]:
    return [100 * v[col] for v in RUNS.values() if v[0] == method]


def _avg(method: str) -> list[float]:
    return [(100 * v[1] + 100 * v[2]) / 2 for v in RUNS.values() if v[0] == method]


def test_rows_follow_the_method_order_by_the_longest_known_label(monkeypatch) -> None:
    # a registered label that holds " (" keeps its own place; a variant of a known label
    # ("TIP (full KL)") follows that label; an unknown one comes after the known ones
    import saopd.analysis.tables as tables

    monkeypatch.setattr(tables, "method_order",
                        lambda: ("OPD", "Floor (kept)", "TIP", "Floor", "SA-OPD"))
    runs = {"o": ("OPD", 0.6, 0.1), "s": ("SA-OPD", 0.7, 0.1), "u": ("Unknown", 0.5, 0.1),
            "f": ("Floor (kept)", 0.6, 0.1), "v": ("TIP (full KL)", 0.6, 0.1),
            "t": ("TIP", 0.6, 0.1), "g": ("Floor (kept) (top-k KL)", 0.6, 0.1),
            "h": ("Floor (other)", 0.6, 0.1)}
    scores, labels = _frames(runs)
    assert results_table(scores, COLUMNS, labels=labels).methods == [
        "OPD", "Floor (kept)", "Floor (kept) (top-k KL)", "TIP", "TIP (full KL)",
        "Floor (other)", "Unknown", "SA-OPD"]


def test_means_spread_average_and_gain() -> None:
    scores, labels = _frames()
    table = results_table(scores, COLUMNS, labels=labels, references={"Student": ["st"]})
    assert table.references == ["Student"]
    assert table.methods == ["OPD", "ExOPD", "TIP", "SA-OPD"]  # baseline first, SA-OPD last
    for method in ("OPD", "SA-OPD", "ExOPD", "TIP"):
        assert table.mean.at[method, "Math500"] == pytest.approx(
            statistics.mean(_values(method, 1)))
        assert table.mean.at[method, AVG] == pytest.approx(statistics.mean(_avg(method)))
        assert table.n[method] == len(_avg(method))
    for method in ("OPD", "SA-OPD"):  # three seeds: sample std (ddof 1)
        assert table.spread.at[method, "AIME24"] == pytest.approx(
            statistics.stdev(_values(method, 2)))
        assert table.spread.at[method, AVG] == pytest.approx(statistics.stdev(_avg(method)))
    assert math.isnan(table.spread.at["TIP", "Math500"])  # one seed: no spread
    opd_avg = statistics.mean(_avg("OPD"))
    assert table.gain["SA-OPD"] == pytest.approx(statistics.mean(_avg("SA-OPD")) - opd_avg)
    assert table.gain["Student"] == pytest.approx(statistics.mean(_avg("student")) - opd_avg)
    assert math.isnan(table.gain["OPD"])
    assert table.delta["AIME24"] == pytest.approx(
        statistics.mean(_values("SA-OPD", 2)) - statistics.mean(_values("OPD", 2)))


def test_ci95_is_t_times_standard_error() -> None:
    scores, labels = _frames()
    table = results_table(scores, COLUMNS, labels=labels, spread="ci95")
    vals = _values("SA-OPD", 1)
    assert table.spread.at["SA-OPD", "Math500"] == pytest.approx(
        t_quantile_975(len(vals) - 1) * statistics.stdev(vals) / math.sqrt(len(vals)))
    # scipy.stats.t.ppf: the printed tables round t(0.975, 2) to 4.303, t(0.975, 100) to 1.984
    assert t_quantile_975(2) == pytest.approx(4.303, abs=5e-4)
    assert t_quantile_975(100) == pytest.approx(1.984, abs=5e-4)


def test_bold_and_underline_with_ties_among_methods_only() -> None:
    scores, labels = _frames()
    table = results_table(scores, COLUMNS, labels=labels, references={"Student": ["st"]})
    marks = table.marks()
    assert "Student" not in marks.index
    # Math500 means: SA-OPD 68.3 > TIP 68.0 > ExOPD 65.0 > OPD 62.0
    assert marks.at["SA-OPD", "Math500"] == "best" and marks.at["TIP", "Math500"] == "second"
    assert marks.at["ExOPD", "Math500"] == marks.at["OPD", "Math500"] == ""
    # AIME24 means: ExOPD 14.0 > SA-OPD 13.0 = TIP 13.0 (a tie shares the mark) > OPD 10.0
    assert marks.at["ExOPD", "AIME24"] == "best"
    assert marks.at["SA-OPD", "AIME24"] == marks.at["TIP", "AIME24"] == "second"

    md = table.to_markdown()
    rows = md_rows(md)
    cells = rows["SA-OPD"]
    assert cells[1].startswith("**68.3 ± ") and cells[2].startswith("<u>13.0 ± ")
    gain = statistics.mean(_avg("SA-OPD")) - statistics.mean(_avg("OPD"))
    assert cells[4] == f"{gain:+.1f}"
    assert rows["Δ over OPD"][1] == f"{table.delta['Math500']:+.1f}"
    assert list(rows).index("Student") < list(rows).index("OPD") < list(rows).index("SA-OPD")

    tex = table.to_latex()
    assert re.search(r"ExOPD & 65\.0 & \\bfseries 14\.0", tex)
    assert r"\underline{68.0}" in tex and r"$\pm$" in tex and r"$\Delta$ over OPD" in tex
    page = table.to_html()
    cells = html_rows(page)["SA-OPD"]
    assert cells[1][0].startswith("68.3 ± ") and "font-weight: bold" in cells[1][1]
    assert "text-decoration: underline" in html_rows(page)["TIP"][1][1]
    assert re.search(r'<td [^>]*class="[^"]*highlight', page)
    assert "standard deviation" in page


def test_missing_benchmark_leaves_avg_empty_and_says_why() -> None:
    scores, labels = _frames()
    scores.at["s1", M2] = float("nan")
    table = results_table(scores, COLUMNS, labels=labels)
    assert math.isnan(table.mean.at["SA-OPD", AVG])
    assert table.mean.at["SA-OPD", "AIME24"] == pytest.approx(100 * (0.12 + 0.13) / 2)
    assert any("s1" in n and "AIME24" in n for n in table.notes)
    assert math.isnan(table.gain["SA-OPD"])
    rows = md_rows(table.to_markdown())
    assert rows["SA-OPD"][1].startswith("**") and "–" in rows["SA-OPD"]


def test_no_baseline_means_no_gain_column() -> None:
    runs = {k: v for k, v in RUNS.items() if v[0] != "OPD"}
    scores, labels = _frames(runs)
    table = results_table(scores, COLUMNS, labels=labels)
    assert table.baseline is None and table.delta is None
    assert GAIN not in table.grid().header
    assert any("no 'OPD' runs" in n for n in table.notes)


def test_bad_inputs_name_the_problem() -> None:
    scores, labels = _frames()
    with pytest.raises(ValueError, match="no runs"):
        results_table(scores.iloc[0:0], COLUMNS, labels=labels)
    with pytest.raises(ValueError, match="metric column"):
        results_table(scores, {"eval/x/avg_at_1": "X"}, labels=labels)
    with pytest.raises(ValueError, match="no method label"):
        results_table(scores, COLUMNS, labels=labels.drop("o0"))
    with pytest.raises(ValueError, match="not among the scores"):
        results_table(scores, COLUMNS, labels=labels, references={"Teacher": ["nope"]})
    with pytest.raises(ValueError, match="spread"):
        results_table(scores, COLUMNS, labels=labels, spread="sem")  # type: ignore[arg-type]


def test_mean_ci95() -> None:
    vals = [0.5, 0.6, 0.7, float("nan")]
    mean, half = mean_ci95(vals)
    assert mean == pytest.approx(0.6, rel=1e-12)
    assert half == pytest.approx(t_quantile_975(2) * statistics.stdev([0.5, 0.6, 0.7])
                                 / math.sqrt(3),
                                 rel=1e-12)
    assert mean_ci95([0.4])[0] == 0.4 and math.isnan(mean_ci95([0.4])[1])
    assert all(math.isnan(x) for x in mean_ci95([]))


def test_paired_recovery_pairs_by_seed_and_scales_by_the_harm() -> None:
    """The harm is control - base over shared seeds (0.2 on each); a method 0.1 above the base on
    every seed recovers half of it; pairs are by seed, not by position (the method lacks seed 2
    and lists its seeds in another order)."""
    scores = {"OPD": {"0": 0.40, "1": 0.50, "2": 0.45},
              "OPD (clean teacher)": {"0": 0.60, "1": 0.70, "2": 0.65},
              "SA-OPD": {"1": 0.60, "0": 0.50}}
    out = paired_recovery(scores, base="OPD", control="OPD (clean teacher)")
    assert out["OPD"]["diff"][0] == 0.0 and out["OPD"]["recovered"][0] == 0.0
    assert out["OPD (clean teacher)"]["recovered"][0] == pytest.approx(1.0, rel=1e-9)
    sa = out["SA-OPD"]
    assert sa["pairs"] == 2
    assert sa["diff"][0] == pytest.approx(0.1, rel=1e-9)
    assert sa["diff"][1] == pytest.approx(0.0, abs=1e-9)  # the same difference on both seeds
    assert sa["recovered"][0] == pytest.approx(0.5, rel=1e-9)
    assert sa["harm"][0] == pytest.approx(0.2, rel=1e-9)
    # no control runs: the differences stand, the recovered share is undefined
    alone = paired_recovery({"OPD": scores["OPD"], "SA-OPD": scores["SA-OPD"]}, base="OPD",
                            control="OPD (clean teacher)")
    assert alone["SA-OPD"]["diff"][0] == pytest.approx(0.1, rel=1e-9)
    assert math.isnan(alone["SA-OPD"]["recovered"][0])
    with pytest.raises(KeyError):
        paired_recovery(scores, base="missing", control="OPD (clean teacher)")


def test_fieller_interval_is_the_set_of_ratios_a_paired_t_test_keeps() -> None:
    """Fieller's interval is {q : the 95% t-interval of mean(num - q den) contains 0}; checked
    against that definition on a fine grid, with a denominator of its own noise."""
    import math

    from saopd.analysis.tables import fieller_ratio_ci95, mean_ci95

    num = [0.05, 0.12, -0.02, 0.09, 0.15, 0.03, 0.07, 0.11]
    den = [0.30, 0.41, 0.22, 0.35, 0.38, 0.25, 0.31, 0.44]
    ratio, low, high = fieller_ratio_ci95(num, den)
    assert ratio == pytest.approx(sum(num) / sum(den), rel=1e-12)

    def kept(q: float) -> bool:
        mean, half = mean_ci95([a - q * b for a, b in zip(num, den, strict=True)])
        return abs(mean) <= half

    grid = [i / 10000 for i in range(-5000, 10001)]
    inside = [q for q in grid if kept(q)]
    assert min(inside) == pytest.approx(low, abs=2e-4)
    assert max(inside) == pytest.approx(high, abs=2e-4)
    assert low < ratio < high
    # a constant denominator: the numerator's t-interval divided by it
    m, h = mean_ci95(num)
    _, lo2, hi2 = fieller_ratio_ci95(num, [0.5] * len(num))
    assert (lo2, hi2) == pytest.approx(((m - h) / 0.5, (m + h) / 0.5), rel=1e-9)
    # a denominator whose own interval includes zero: unbounded
    _, lo3, hi3 = fieller_ratio_ci95(num, [0.1, -0.2, 0.15, -0.1, 0.05, -0.05, 0.2, -0.1])
    assert lo3 == -math.inf and hi3 == math.inf
    assert all(math.isnan(x) for x in fieller_ratio_ci95([], [])) and \
        math.isnan(fieller_ratio_ci95([0.1], [0.2])[1])


def _three_methods(sa: tuple[float, ...]) -> tuple[pd.DataFrame, pd.Series]:
    vals = {"OPD": (0.60, 0.62, 0.64), "TIP": (0.61, 0.66, 0.63), "SA-OPD": sa}
    rows = {f"{m[:2]}{i}": (m, v) for m, vs in vals.items() for i, v in enumerate(vs)}
    scores = pd.DataFrame({M1: [v for _, v in rows.values()]}, index=list(rows))
    return scores, pd.Series([m for m, _ in rows.values()], index=list(rows))


def test_interval_marks_bold_only_a_method_whose_interval_separates() -> None:
    from saopd.analysis.tables import auto_decimals

    cols = {M1: "Math500"}
    scores, labels = _three_methods((0.80, 0.81, 0.82))  # far above the others
    table = results_table(scores, cols, labels=labels, spread="ci95", decimals=None,
                          marking="interval")
    ci = table.ci.at["SA-OPD", "Math500"]
    assert ci == pytest.approx(t_quantile_975(2) * 1.0 / math.sqrt(3), rel=1e-9)
    assert table.marks().at["SA-OPD", "Math500"] == "best"
    assert set(table.marks()["Math500"]) == {"best", ""}  # no second mark
    # a higher mean whose interval overlaps TIP's: no bold at all
    scores, labels = _three_methods((0.64, 0.70, 0.76))
    table = results_table(scores, cols, labels=labels, spread="ci95", marking="interval")
    assert table.mean.at["SA-OPD", "Math500"] > table.mean.at["TIP", "Math500"]
    assert set(table.marks()["Math500"]) == {""}
    assert "**" not in table.to_markdown() and "interval over seeds lies above" in \
        table.to_markdown()
    # rounded to two significant digits of the smallest interval
    assert auto_decimals([2.9, 6.3]) == 1 and auto_decimals([0.25]) == 2
    assert auto_decimals([14.0]) == 0 and auto_decimals([float("nan")], fallback=3) == 3


def test_runs_lacking_a_metric_are_one_note_that_counts_them() -> None:
    ids = [f"r{i}" for i in range(16)]
    scores = pd.DataFrame({M1: [0.5] + [float("nan")] * 15}, index=ids)
    labels = pd.Series(["OPD"] * 16, index=ids)
    table = results_table(scores, {M1: "Math500"}, labels=labels)
    lacking = [n for n in table.notes if "lack" in n]
    assert len(lacking) == 1
    assert lacking[0].startswith("15 of 16 runs lack Math500 (not logged, or NaN): OPD (r1), ")
    assert "OPD (r0)" not in lacking[0] and "and 7 more" in lacking[0]
