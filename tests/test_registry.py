"""Properties every registered filter and objective must have (hypothesis, registry-wide).

A new filter or objective is covered here from the moment it is registered.
"""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from saopd.filters import FILTERS
from saopd.models.tiny import tiny_tokenizer
from saopd.objectives import OBJECTIVES, aggregate
from saopd.signals import TokenSignals
from tests.conftest import random_signals as plain_signals
from tests.signals.topk_data import TOPK_K, with_topk

FILTER_NAMES = FILTERS.names()
OBJECTIVE_NAMES = OBJECTIVES.names()


def random_signals(batch: int, length: int, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                   student_grad: bool = False, **kw: object) -> TokenSignals:
    """``tests.conftest.random_signals`` plus both top-K groups (``tests.signals.topk_data``)."""
    s = plain_signals(batch, length, seed=seed, dtype=dtype, student_grad=student_grad, **kw)
    return with_topk(s, seed=seed, dtype=dtype, student_grad=student_grad)


def step(signals: TokenSignals, filter_name: str, objective_name: str, seed: int = 0,
         **filter_kw: object):
    token_filter = FILTERS.build(filter_name, **filter_kw)
    token_filter.bind_tokenizer(tiny_tokenizer())  # what the training module does
    result = token_filter(signals, generator=torch.Generator().manual_seed(seed))
    out = OBJECTIVES.build(objective_name)(signals, result)
    return result, out, aggregate(out.loss, result.keep)


def pad(signals: TokenSignals, extra: int, seed: int) -> TokenSignals:
    """The same batch with ``extra`` more columns of garbage at invalid positions."""
    g = torch.Generator().manual_seed(seed)
    values = {}
    for name in (f.name for f in dataclasses.fields(signals)):
        value = getattr(signals, name)
        if value is None:
            continue
        if name == "valid":
            values[name] = torch.cat([value, torch.zeros(value.shape[0], extra, dtype=torch.bool)],
                                     1)
        elif name.endswith("_ids"):  # junk ids, repeated ones too
            junk = torch.randint(0, 3, (value.shape[0], extra, *value.shape[2:]), generator=g)
            values[name] = torch.cat([value, junk], 1)
        else:
            junk = -5 * torch.rand(value.shape[0], extra, *value.shape[2:], generator=g)
            values[name] = torch.cat([value.detach(), junk], 1)
    return TokenSignals(**values)


def with_(s: TokenSignals, **changes: torch.Tensor) -> TokenSignals:
    new = dataclasses.replace(s, **changes)
    new.student_leaf = s.student_leaf  # type: ignore[attr-defined]
    new.topk_leaf = s.topk_leaf  # type: ignore[attr-defined]
    return new


def test_registry_is_complete() -> None:
    assert set(FILTER_NAMES) >= {"none", "sa_opd", "random", "divergence_only", "ig_only",
                                 "proxy_replacement", "tip", "fire", "teachability"}
    assert set(OBJECTIVE_NAMES) >= {"sampled", "full_kl", "exopd", "topk_kl", "entropy_aware"}


@pytest.mark.parametrize("objective_name", OBJECTIVE_NAMES)
@pytest.mark.parametrize("filter_name", FILTER_NAMES)
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 1000), extra=st.integers(1, 5), valid_p=st.sampled_from([0.0, 0.5, 1.0]))
def test_padding_changes_nothing(filter_name, objective_name, seed, extra, valid_p) -> None:
    s = random_signals(3, 8, seed=seed, valid_p=valid_p)
    padded = pad(s, extra, seed + 1)
    r1, o1, l1 = step(s, filter_name, objective_name)
    r2, o2, l2 = step(padded, filter_name, objective_name)
    assert torch.equal(r1.keep, r2.keep[:, :8]) and not r2.keep[:, 8:].any()
    torch.testing.assert_close(r1.weights, r2.weights[:, :8], rtol=0, atol=0)
    assert r1.stats == r2.stats
    assert torch.equal(o1.loss, o2.loss[:, :8]) and not o2.loss[:, 8:].any()
    torch.testing.assert_close(l1, l2, rtol=0, atol=0)


@pytest.mark.parametrize("objective_name", OBJECTIVE_NAMES)
@pytest.mark.parametrize("filter_name", FILTER_NAMES)
@pytest.mark.parametrize("case", ["all_masked", "one_valid", "identical_models", "bf16", "fp16",
                                  "minus_inf_teacher"])
def test_no_nan_or_inf(filter_name, objective_name, case) -> None:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(case, torch.float32)
    s = random_signals(3, 8, seed=1, dtype=dtype, student_grad=True,
                       valid_p={"all_masked": 0.0}.get(case, 0.7))
    if case == "one_valid":
        one = torch.zeros(3, 8, dtype=torch.bool)
        one[1, 2] = True
        s = with_(s, valid=one)
    if case == "identical_models":  # A_full == 0 everywhere: no loss mass at all
        s = with_(s, lp_teacher=s.lp_student.detach().clone(), lp_teacher_res=s.lp_student_res,
                  teacher_topk_lp_teacher=s.teacher_topk_lp_student.detach().clone(),
                  student_topk_lp_teacher=s.student_topk_lp_student)
    if case == "minus_inf_teacher":
        minus_inf = torch.full((3, 8, TOPK_K), float("-inf"))
        s = with_(s, lp_teacher=torch.full((3, 8), float("-inf")),
                  teacher_topk_lp_teacher=minus_inf, student_topk_lp_teacher=minus_inf)
    result, out, loss = step(s, filter_name, objective_name)
    assert torch.isfinite(out.loss).all() and torch.isfinite(loss)
    assert all(torch.isfinite(v) for v in out.metrics.values())
    assert all(v == v and abs(v) != float("inf") for v in result.stats.values())
    assert not (result.keep & ~s.valid).any()
    assert torch.equal(result.keep | result.filtered, s.valid)
    assert not (result.keep & result.filtered).any()
    if loss.requires_grad:
        grads = torch.autograd.grad(loss, [s.student_leaf, s.topk_leaf], allow_unused=True)
        assert all(grad is None or torch.isfinite(grad).all() for grad in grads)


@pytest.mark.parametrize("objective_name", OBJECTIVE_NAMES)
def test_every_token_filtered_gives_zero_loss(objective_name) -> None:
    s = random_signals(3, 8, seed=2, student_grad=True)
    # p1 = p2 = 1: Bottom_1(gap) ∩ Top_1(|A|) = every valid token
    result, _, loss = step(s, "sa_opd", objective_name, p1=1.0, p2=1.0)
    assert not result.keep.any() and result.stats["flmr"] == pytest.approx(1.0)
    assert loss.item() == 0.0


@pytest.mark.parametrize("objective_name", OBJECTIVE_NAMES)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), p2=st.floats(0, 1), beta_min=st.sampled_from([None, 0.3]))
def test_sa_opd_with_p1_zero_is_vanilla_opd(objective_name, seed, p2, beta_min) -> None:
    s = random_signals(4, 10, seed=seed, student_grad=True)
    r_sa, o_sa, l_sa = step(s, "sa_opd", objective_name, p1=0.0, p2=p2, beta_min=beta_min)
    r_no, o_no, l_no = step(s, "none", objective_name)
    assert torch.equal(r_sa.keep, r_no.keep)
    assert torch.equal(o_sa.loss, o_no.loss) and torch.equal(l_sa, l_no)


def test_a_declared_plug_in_is_imported_on_first_get(tmp_path, monkeypatch) -> None:
    from saopd.registry import Registry

    (tmp_path / "late_plugin_mod.py").write_text(
        "from tests.test_registry import LATE\n"
        "@LATE.register('late')\n"
        "class Late:\n"
        "    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(globals(), "LATE", Registry("late thing"))
    registry = globals()["LATE"]
    registry.declare("late", "late_plugin_mod")
    assert "late" in registry and registry.names() == ["late"]
    import sys
    assert "late_plugin_mod" not in sys.modules
    cls = registry.get("late")
    assert cls.__name__ == "Late" and cls.__module__ == "late_plugin_mod"
    assert registry.get("late") is cls
    with pytest.raises(ValueError, match="registered twice"):
        registry.declare("late", "late_plugin_mod")
    registry.declare("ghost", "late_plugin_mod")  # the module does not register it
    with pytest.raises(ValueError, match="did not register it"):
        registry.get("ghost")
    with pytest.raises(ValueError, match="declared in elsewhere_mod"):
        registry.declare("other", "elsewhere_mod")
        registry.register("other")(type("Other", (), {}))
    monkeypatch.delitem(sys.modules, "late_plugin_mod")
