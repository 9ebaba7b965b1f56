"""Tests of saopd.signals.logprobs: chunked scoring equals the plain full-vocabulary computation
(values and gradients), handles masked vocabularies and low precision, validates its inputs and
never builds a logits block of more than ``chunk_size`` positions."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from saopd.signals import LMHead, Logits, TokenScores, default_chunk_size, score_tokens
from tests.helpers.tolerance import assert_float_close

B, T, V, H = 3, 7, 37, 6  # B*T = 21 positions
CHUNKS = [1, 2, 4, 5, 20, 21, 22, 1000]  # 4, 5, 20, 22 do not divide 21; 22/1000 > B*T
# fp32 implementation vs the plain computation, never loosened: 4 float32 ulps relative to each
# value and, absolutely, to the logits' magnitude (|z / temperature| of _inputs reaches ~20 at
# temperature 0.7): a log-prob z - logsumexp(z) carries ~eps * max|z| even where it is near 0
ULPS = 4
RTOL = ULPS * torch.finfo(torch.float32).eps  # 4.8e-7
ATOL = RTOL * 20.0  # 9.5e-6


def _plain(z_s: torch.Tensor, targets: torch.Tensor, z_t: torch.Tensor | None = None,
           temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """The reference: full [B, T, V] log_softmax, in the dtype of the logits given. Terms with
    p = 0 are zeroed *before* the product, so autograd gives no 0 * inf = NaN there."""
    logp = torch.log_softmax(z_s / temperature, dim=-1)
    p = logp.exp()
    out = {
        "logprobs": logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1),
        "entropy": -(p * logp.masked_fill(p == 0, 0.0)).sum(-1),
    }
    if z_t is not None:
        logq = torch.log_softmax(z_t / temperature, dim=-1).detach()
        q = logq.exp()
        out["teacher_logprobs"] = logq.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        out["teacher_entropy"] = -(q * logq.masked_fill(q == 0, 0.0)).sum(-1)
        out["kl"] = (p * (logp - logq).masked_fill(p == 0, 0.0)).sum(-1)
    return out


def _inputs(seed: int = 0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype)
    bias = torch.randn(V, generator=g, dtype=dtype)
    teacher = 2 * torch.randn(B, T, V, generator=g, dtype=dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    return hidden, weight, bias, teacher, targets


def _close(actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL) -> None:
    torch.testing.assert_close(actual, expected.to(actual.dtype), atol=atol, rtol=RTOL)


def _score_all(source, targets, teacher, **kw) -> TokenScores:
    return score_tokens(source, targets, teacher=Logits(teacher), entropy=True,
                        teacher_entropy=True, kl=True, **kw)


def _check_all(scores: TokenScores, ref: dict[str, torch.Tensor]) -> None:
    for name, expected in ref.items():
        actual = getattr(scores, name)
        assert actual.dtype == torch.float32 and actual.shape == (B, T), name
        _close(actual, expected)


# ---- values ---------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logits_source_matches_plain(chunk_size: int, temperature: float) -> None:
    hidden, weight, bias, teacher, targets = _inputs()
    logits = hidden @ weight.T + bias
    scores = _score_all(Logits(logits), targets, teacher, chunk_size=chunk_size,
                        temperature=temperature)
    _check_all(scores, _plain(logits, targets, teacher, temperature))


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_lm_head_source_matches_plain(chunk_size: int, with_bias: bool) -> None:
    hidden, weight, bias, teacher, targets = _inputs(1)
    bias = bias if with_bias else None
    logits = hidden @ weight.T + (0 if bias is None else bias)
    scores = _score_all(LMHead(hidden, weight, bias), targets, teacher, chunk_size=chunk_size)
    _check_all(scores, _plain(logits, targets, teacher))


def test_lm_head_teacher_and_optional_fields() -> None:
    hidden, weight, _, teacher, targets = _inputs(2)
    t_head = LMHead(hidden.flip(0), weight.flip(1), None)
    scores = score_tokens(Logits(teacher), targets, teacher=t_head, kl=True, chunk_size=4)
    ref = _plain(teacher, targets, hidden.flip(0) @ weight.flip(1).T)
    assert scores.entropy is None and scores.teacher_entropy is None
    for name in ("logprobs", "teacher_logprobs", "kl"):
        _close(getattr(scores, name), ref[name])
    only = score_tokens(Logits(teacher), targets)
    assert (only.entropy, only.teacher_logprobs, only.teacher_entropy, only.kl) == (None,) * 4
    _close(only.logprobs, ref["logprobs"])


def test_non_contiguous_sources() -> None:
    """Shifted views ([:, :-1]) cannot be flattened as a view; chunks that straddle sequences
    must still pick the right rows."""
    hidden, weight, bias, teacher, _ = _inputs(3)
    targets = torch.randint(0, V, (B, T - 1), generator=torch.Generator().manual_seed(3))
    h_view, t_view = hidden[:, 1:], teacher[:, :-1]
    assert not t_view.is_contiguous()
    logits = h_view @ weight.T + bias
    for chunk_size in (4, 5):
        scores = score_tokens(LMHead(h_view, weight, bias), targets, teacher=Logits(t_view),
                              entropy=True, kl=True, chunk_size=chunk_size)
        ref = _plain(logits, targets, t_view)
        for name in ("logprobs", "entropy", "teacher_logprobs", "kl"):
            _close(getattr(scores, name), ref[name])


def test_chunk_method_and_default_chunk_size() -> None:
    hidden, weight, bias, _, _ = _inputs(4)
    head = LMHead(hidden, weight, bias)
    full = (hidden @ weight.T + bias).reshape(B * T, V)
    _close(head.chunk(5, 12), full[5:12])
    _close(Logits(full.view(B, T, V).to(torch.bfloat16)).chunk(0, 3),
           full[:3].to(torch.bfloat16).float())
    assert head.batch_shape == (B, T) and head.vocab_size == V
    assert default_chunk_size(151_936) == 441
    assert default_chunk_size(10**12) == 1
    assert default_chunk_size(1000, budget_bytes=4000) == 1
    with pytest.raises(ValueError, match="vocab_size"):
        default_chunk_size(0)


# ---- gradients ------------------------------------------------------------------------------


def _upstream(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, T, generator=g) for _ in range(3))  # type: ignore[return-value]


def _loss(scores, g_lp, g_h, g_kl) -> torch.Tensor:
    def get(name):
        return scores[name] if isinstance(scores, dict) else getattr(scores, name)

    return ((get("logprobs") * g_lp).sum() + (get("entropy") * g_h).sum()
            + (get("kl") * g_kl).sum())


@pytest.mark.parametrize("chunk_size", [1, 4, 22])
@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_logits_gradient_matches_plain(chunk_size: int, temperature: float) -> None:
    """Reference: plain fp32 autograd on the same values; 1e-5 absolute."""
    hidden, weight, bias, teacher, targets = _inputs(5)
    base = (hidden @ weight.T + bias).detach()
    ups = _upstream(5)

    z = base.clone().requires_grad_(True)
    scores = _score_all(Logits(z), targets, teacher, chunk_size=chunk_size,
                        temperature=temperature)
    _loss(scores, *ups).backward()

    z_ref = base.clone().requires_grad_(True)
    _loss(_plain(z_ref, targets, teacher, temperature), *ups).backward()
    _close(z.grad, z_ref.grad)


@pytest.mark.parametrize("chunk_size", [1, 4, 22])
def test_lm_head_gradient_matches_plain(chunk_size: int) -> None:
    """Reference: plain fp64 autograd (the exact gradient); the fp32 chunked result is within
    1e-5 absolute of it for hidden, weight and bias."""
    hidden, weight, bias, teacher, targets = _inputs(6)
    ups = _upstream(6)

    params = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    scores = _score_all(LMHead(*params), targets, teacher, chunk_size=chunk_size)
    _loss(scores, *ups).backward()

    ref = [t.double().requires_grad_(True) for t in (hidden, weight, bias)]
    logits = ref[0] @ ref[1].T + ref[2]
    _loss(_plain(logits, targets, teacher.double()), *(u.double() for u in ups)).backward()
    for mine, theirs in zip(params, ref, strict=True):
        assert mine.grad.dtype == torch.float32
        _close(mine.grad, theirs.grad)


def test_gradient_of_single_outputs_and_partial_requires_grad() -> None:
    """Only the entropy (or only the KL) used; only the weight requires grad."""
    hidden, weight, bias, teacher, targets = _inputs(7)
    for name in ("entropy", "kl"):
        w = weight.clone().requires_grad_(True)
        scores = _score_all(LMHead(hidden, w, bias), targets, teacher, chunk_size=5)
        getattr(scores, name).sum().backward()
        w_ref = weight.clone().requires_grad_(True)
        _plain(hidden @ w_ref.T + bias, targets, teacher)[name].sum().backward()
        _close(w.grad, w_ref.grad)


def test_teacher_gets_no_gradient() -> None:
    hidden, weight, bias, teacher, targets = _inputs(8)
    z = (hidden @ weight.T).detach().requires_grad_(True)
    t_logits = teacher.clone().requires_grad_(True)
    t_head = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
    for t_source in (Logits(t_logits), LMHead(*t_head)):
        scores = score_tokens(Logits(z), targets, teacher=t_source, entropy=True,
                              teacher_entropy=True, kl=True, chunk_size=4)
        assert not scores.teacher_logprobs.requires_grad
        assert not scores.teacher_entropy.requires_grad
        (scores.logprobs.sum() + scores.kl.sum()).backward()
    assert z.grad is not None
    assert t_logits.grad is None and all(x.grad is None for x in t_head)


def test_no_graph_under_no_grad_or_without_requires_grad() -> None:
    hidden, weight, _, teacher, targets = _inputs(9)
    z = (hidden @ weight.T).detach().requires_grad_(True)
    with torch.no_grad():
        scores = _score_all(Logits(z), targets, teacher)
    assert all(getattr(scores, f).grad_fn is None for f in ("logprobs", "entropy", "kl"))
    assert not scores.logprobs.requires_grad
    plain = _score_all(Logits(z.detach()), targets, teacher)
    assert plain.logprobs.grad_fn is None and not plain.kl.requires_grad


def test_teacher_not_kept_alive_without_kl() -> None:
    """The graph only holds the teacher when the KL gradient needs it."""
    _, _, _, teacher, targets = _inputs(15)
    z = teacher.flip(-1).clone().requires_grad_(True)
    t_logits = teacher.clone()
    ref = weakref.ref(t_logits)
    scores = score_tokens(Logits(z), targets, teacher=Logits(t_logits), chunk_size=4)
    del t_logits
    gc.collect()
    assert ref() is None and scores.logprobs.grad_fn is not None
    scores.logprobs.sum().backward()
    assert z.grad is not None


def test_empty_batch() -> None:
    z = torch.randn(2, 0, V, requires_grad=True)
    targets = torch.zeros(2, 0, dtype=torch.long)
    scores = score_tokens(Logits(z), targets, teacher=Logits(torch.randn(2, 0, V)),
                          entropy=True, kl=True)
    assert scores.logprobs.shape == scores.kl.shape == (2, 0)
    (scores.logprobs.sum() + scores.kl.sum()).backward()
    assert z.grad.shape == z.shape


# ---- masked vocabulary ----------------------------------------------------------------------


def test_minus_inf_logits_no_nan() -> None:
    hidden, weight, bias, teacher, targets = _inputs(10)
    base = hidden @ weight.T + bias
    mask = torch.zeros(V, dtype=torch.bool)
    mask[::3] = True  # vocabulary entries 0, 3, 6, ... are masked in both models
    z_s = base.masked_fill(mask, float("-inf"))
    z_t = teacher.masked_fill(mask, float("-inf"))
    targets = targets.clone()
    targets[0, 0], targets[1, 2] = 0, 3  # two targets on masked entries
    z = z_s.clone().requires_grad_(True)
    scores = score_tokens(Logits(z), targets, teacher=Logits(z_t), entropy=True,
                          teacher_entropy=True, kl=True, chunk_size=4)
    assert scores.logprobs[0, 0] == float("-inf") and scores.logprobs[1, 2] == float("-inf")
    assert scores.teacher_logprobs[0, 0] == float("-inf")
    for name in ("entropy", "teacher_entropy", "kl"):
        assert torch.isfinite(getattr(scores, name)).all(), name
    assert not torch.isnan(scores.logprobs).any()
    ref = _plain(z_s, targets, z_t)
    for name in ("entropy", "teacher_entropy", "kl"):
        _close(getattr(scores, name), ref[name])
    finite = torch.isfinite(ref["logprobs"])
    _close(scores.logprobs[finite], ref["logprobs"][finite])

    # gradients stay finite and equal the plain ones (upstream on entropy, kl and the finite
    # log-probs; a -inf log-prob's gradient w.r.t. the logits is still finite)
    ups = _upstream(10)
    _loss(scores, *ups).backward()
    assert torch.isfinite(z.grad).all()
    # a masked entry's only gradient is d lpS / du_y = 1 at a masked target (p = 0 there)
    expected = torch.zeros(B, T, V).scatter_(-1, targets.unsqueeze(-1), ups[0].unsqueeze(-1))
    assert torch.equal(z.grad[..., mask], expected[..., mask])
    z_ref = z_s.clone().requires_grad_(True)
    _loss(_plain(z_ref, targets, z_t), *ups).backward()
    _close(z.grad, z_ref.grad)


# ---- low precision --------------------------------------------------------------------------


def test_bf16_inputs_give_fp32_close_to_upcast() -> None:
    hidden, weight, bias, teacher, targets = _inputs(11)
    logits16 = (hidden @ weight.T + bias).to(torch.bfloat16)
    teacher16 = teacher.to(torch.bfloat16)
    scores = score_tokens(Logits(logits16), targets, teacher=Logits(teacher16), entropy=True,
                          teacher_entropy=True, kl=True, chunk_size=4)
    _check_all(scores, _plain(logits16.float(), targets, teacher16.float()))

    h16, w16, b16 = (x.to(torch.bfloat16).requires_grad_(True) for x in (hidden, weight, bias))
    scores = score_tokens(LMHead(h16, w16, b16), targets, entropy=True, chunk_size=5)
    ref_params = [x.detach().float().requires_grad_(True) for x in (h16, w16, b16)]
    ref = _plain(ref_params[0] @ ref_params[1].T + ref_params[2], targets)
    for name in ("logprobs", "entropy"):
        _close(getattr(scores, name), ref[name])
    (scores.logprobs.sum() + scores.entropy.sum()).backward()
    (ref["logprobs"].sum() + ref["entropy"].sum()).backward()
    for mine, theirs in zip((h16, w16, b16), ref_params, strict=True):
        assert mine.grad.dtype == torch.bfloat16
        # the fp32 gradient is exact to 1e-5; the only further error is the final bf16 rounding
        torch.testing.assert_close(mine.grad, theirs.grad.to(torch.bfloat16))


def test_fp32_under_bf16_autocast() -> None:
    """Lightning's ``bf16-mixed`` runs ``training_step`` inside ``torch.autocast``, under which
    an fp32 matmul runs in bf16. Scoring must not notice: values and gradients equal the
    no-autocast ones (same fp32 ops in the same order), while a bf16 head product would be far
    off (checked, so the comparison can fail)."""
    g = torch.Generator().manual_seed(21)
    hidden = torch.randn(B, T, 64, generator=g)
    weight = torch.randn(V, 64, generator=g) / 4
    bias = torch.randn(V, generator=g)
    teacher_h = torch.randn(B, T, 64, generator=g)
    teacher_w = torch.randn(V, 64, generator=g) / 4
    targets = torch.randint(0, V, (B, T), generator=g)

    def run(autocast: bool) -> tuple[TokenScores, list[torch.Tensor]]:
        params = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            head = LMHead(*params)
            scores = score_tokens(head, targets, teacher=LMHead(teacher_h, teacher_w),
                                  entropy=True, teacher_entropy=True, kl=True, chunk_size=4)
            chunk = head.chunk(0, B * T)
            loss = scores.logprobs.sum() + scores.entropy.sum() + scores.kl.sum()
            loss.backward()  # inside autocast too: the custom backward must not care
        return scores, [chunk, *(p.grad for p in params)]

    plain, plain_grads = run(False)
    mixed, mixed_grads = run(True)
    for name in ("logprobs", "entropy", "teacher_logprobs", "teacher_entropy", "kl"):
        assert getattr(mixed, name).dtype == torch.float32
        torch.testing.assert_close(getattr(mixed, name), getattr(plain, name), atol=1e-6, rtol=0)
    for got, want in zip(mixed_grads, plain_grads, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # what the head product gives in bf16 (what autocast would have done): clearly different
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16_product = hidden.view(-1, 64) @ weight.T
    assert bf16_product.dtype == torch.bfloat16
    assert (bf16_product.float() + bias - plain_grads[0]).abs().max() > 1e-3


# ---- errors ---------------------------------------------------------------------------------


def test_errors() -> None:
    hidden, weight, _, teacher, targets = _inputs(12)
    src = Logits(teacher)
    bad = targets.clone()
    bad[1, 1] = V
    with pytest.raises(ValueError, match=rf"targets.*{V}.*{V}"):
        score_tokens(src, bad)
    bad[1, 1] = -2
    with pytest.raises(ValueError, match=rf"targets.*V = {V}, got -2"):
        score_tokens(src, bad)
    with pytest.raises(ValueError, match=r"targets has shape \(3, 6\).*\(3, 7\)"):
        score_tokens(src, targets[:, :-1])
    with pytest.raises(ValueError, match="targets must be an integer"):
        score_tokens(src, targets.float())
    with pytest.raises(ValueError, match=r"teacher has shape .*\(3, 7, 36\).*\(3, 7, 37\)"):
        score_tokens(src, targets, teacher=Logits(teacher[..., :-1]))
    with pytest.raises(ValueError, match=r"teacher has shape .*\(2, 7, 37\).*\(3, 7, 37\)"):
        score_tokens(src, targets, teacher=Logits(teacher[:2]))
    with pytest.raises(ValueError, match=r"temperature.*got 0"):
        score_tokens(src, targets, temperature=0.0)
    with pytest.raises(ValueError, match=r"temperature.*got -1"):
        score_tokens(src, targets, temperature=-1)
    with pytest.raises(ValueError, match=r"chunk_size.*got 0"):
        score_tokens(src, targets, chunk_size=0)
    with pytest.raises(ValueError, match="kl=True needs a teacher"):
        score_tokens(src, targets, kl=True)
    with pytest.raises(ValueError, match="teacher_entropy=True needs a teacher"):
        score_tokens(src, targets, teacher_entropy=True)
    with pytest.raises(ValueError, match=r"LMHead.weight has shape \(37, 5\)"):
        LMHead(hidden, weight[:, :-1])
    with pytest.raises(ValueError, match=r"Logits\.logits must be 3-D"):
        Logits(teacher[0])
    with pytest.raises(ValueError, match="source must be a Logits or LMHead"):
        score_tokens(teacher, targets)  # type: ignore[arg-type]


# ---- memory flatness (deterministic: counts rows, never measures memory) --------------------


def _storages(obj) -> set[int]:
    if isinstance(obj, torch.Tensor):
        return {obj.untyped_storage().data_ptr()}
    if isinstance(obj, (tuple, list)):
        return set().union(*(_storages(o) for o in obj)) if obj else set()
    return set()


class _LargestVocabBlock(TorchDispatchMode):
    """Records, for every tensor newly allocated by an op (views and in-place results, which
    share an input's storage, are skipped) whose last dimension is V, its number of rows
    (numel / V). A plain implementation would allocate [B, T, V] (B*T rows)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.max_rows, self.ops = vocab, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = _storages(list(args) + list((kwargs or {}).values()))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for o in outs:
            if (isinstance(o, torch.Tensor) and o.dim() >= 1 and o.shape[-1] == self.vocab
                    and o.untyped_storage().data_ptr() not in inputs):
                self.ops += 1
                self.max_rows = max(self.max_rows, o.numel() // self.vocab)
        return out


@pytest.mark.parametrize("chunk_size", [1, 5])
def test_memory_flat_lm_head(chunk_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    hidden, weight, bias, _, targets = _inputs(13)
    asked: list[int] = []
    original = LMHead.chunk

    def spy(self, start, end):
        asked.append(end - start)
        return original(self, start, end)

    monkeypatch.setattr(LMHead, "chunk", spy)
    params = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
    t_head = LMHead(hidden.flip(1), weight.flip(0), bias)  # same shapes, different model
    with _LargestVocabBlock(V) as mode:
        scores = score_tokens(LMHead(*params), targets, teacher=t_head, entropy=True,
                              teacher_entropy=True, kl=True, chunk_size=chunk_size)
        (scores.logprobs.sum() + scores.entropy.sum() + scores.kl.sum()).backward()
    n_chunks = -(-B * T // chunk_size)
    # forward: source + teacher per chunk; backward: source + teacher (kl) per chunk
    assert len(asked) == 4 * n_chunks and max(asked) == chunk_size
    assert mode.ops > 0 and mode.max_rows <= chunk_size
    assert all(p.grad is not None for p in params)


def test_memory_flat_logits_no_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a Logits source the input itself is [B, T, V]; nothing else of that size is made."""
    _, _, _, teacher, targets = _inputs(14)
    asked: list[int] = []
    original = Logits.chunk
    monkeypatch.setattr(Logits, "chunk",
                        lambda self, s, e: asked.append(e - s) or original(self, s, e))
    logits = teacher.flip(-1).to(torch.bfloat16)
    with _LargestVocabBlock(V) as mode, torch.no_grad():
        score_tokens(Logits(logits), targets, teacher=Logits(teacher), entropy=True,
                     teacher_entropy=True, kl=True, chunk_size=3)
    assert max(asked) == 3 and len(asked) == 2 * 7
    assert mode.max_rows <= 3


# ---- top-k distributions --------------------------------------------------------------------


def _ref_top_k(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (-value, id) order spelled out: per row, python's sort of (-value, id) pairs."""
    rows = logp.reshape(-1, logp.shape[-1]).tolist()
    ids = [[i for _, i in sorted((-v, i) for i, v in enumerate(row))[:k]] for row in rows]
    ids_t = torch.tensor(ids, dtype=torch.long).view(*logp.shape[:-1], k)
    return ids_t, logp.gather(-1, ids_t)


def _topk_plain(z_s: torch.Tensor, z_t: torch.Tensor, k_s: int, k_t: int,
                temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """Float64 full-logit reference of every top-k output."""
    logp = torch.log_softmax(z_s.double() / temperature, dim=-1)
    logq = torch.log_softmax(z_t.double() / temperature, dim=-1)
    s_ids, s_lp = _ref_top_k(logp, k_s)
    t_ids, t_lp = _ref_top_k(logq, k_t)
    return {"topk_ids": s_ids, "topk_logprobs": s_lp,
            "teacher_logprobs_at_topk": logq.gather(-1, s_ids),
            "teacher_topk_ids": t_ids, "teacher_topk_logprobs": t_lp,
            "logprobs_at_ids": logp.gather(-1, t_ids)}


def _check_topk(scores: TokenScores, ref: dict[str, torch.Tensor]) -> None:
    for name, expected in ref.items():
        actual = getattr(scores, name)
        assert actual.shape == expected.shape, name
        if name.endswith("_ids") and "logprobs" not in name:
            assert actual.dtype == torch.int64 and torch.equal(actual, expected), name
        else:
            assert actual.dtype == torch.float32, name
            _close(actual, expected)


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("ks", [(1, 1), (5, 3), (V, V)])
def test_top_k_matches_float64_reference(chunk_size: int, temperature: float,
                                         ks: tuple[int, int]) -> None:
    hidden, weight, bias, teacher, targets = _inputs(30)
    logits = hidden @ weight.T + bias
    for source in (Logits(logits), LMHead(hidden, weight, bias)):
        scores = score_tokens(source, targets, teacher=Logits(teacher), top_k=ks[0],
                              teacher_top_k=ks[1], kl=True, chunk_size=chunk_size,
                              temperature=temperature)
        _check_topk(scores, _topk_plain(logits, teacher, *ks, temperature))
        # the other outputs are unchanged by asking for top-k
        _close(scores.kl, _plain(logits, targets, teacher, temperature)["kl"])
        # the first k' columns of a top-k list are the top-k' list
        if ks[0] > 1:
            small = score_tokens(source, targets, top_k=1, chunk_size=chunk_size,
                                 temperature=temperature)
            assert torch.equal(small.topk_ids, scores.topk_ids[..., :1])


@pytest.mark.parametrize("chunk_size", [1, 4, 22])
@pytest.mark.parametrize("k", [1, 3, 8, V])
def test_top_k_ties_by_smallest_id(chunk_size: int, k: int) -> None:
    """Integer logits in {0, 1, 2}: nearly every row ties across the k-th value; the kept ids
    are the smallest tied ones and the order is (-log-prob, id), in every chunking."""
    g = torch.Generator().manual_seed(31)
    z_s = torch.randint(0, 3, (B, T, V), generator=g).float()
    z_t = torch.randint(0, 3, (B, T, V), generator=g).float()
    z_t[0, 0] = 1.0  # a row where every entry ties
    targets = torch.randint(0, V, (B, T), generator=g)
    scores = score_tokens(Logits(z_s), targets, teacher=Logits(z_t), top_k=k, teacher_top_k=k,
                          chunk_size=chunk_size)
    _check_topk(scores, _topk_plain(z_s, z_t, k, k))
    assert torch.equal(scores.teacher_topk_ids[0, 0], torch.arange(k))


def test_top_k_with_masked_vocabulary() -> None:
    """Fewer finite entries than K: the smallest masked ids fill the list with -inf."""
    hidden, weight, bias, teacher, targets = _inputs(32)
    z = hidden @ weight.T + bias
    mask = torch.ones(V, dtype=torch.bool)
    mask[[3, 10, 20]] = False  # only three finite entries
    z = z.masked_fill(mask, float("-inf"))
    scores = score_tokens(Logits(z), targets, teacher=Logits(teacher), top_k=6, chunk_size=4)
    ref = _topk_plain(z, teacher, 6, 1)
    assert torch.equal(scores.topk_ids, ref["topk_ids"])
    assert torch.equal(scores.topk_ids[..., 3:], torch.tensor([0, 1, 2]).expand(B, T, 3))
    assert torch.isneginf(scores.topk_logprobs[..., 3:]).all()
    _close(scores.topk_logprobs[..., :3], ref["topk_logprobs"][..., :3])


def test_top_k_ignores_padding() -> None:
    """Positions appended as padding (any logits, any target) change nothing at the others."""
    hidden, weight, bias, teacher, targets = _inputs(33)
    g = torch.Generator().manual_seed(33)
    pad_h = torch.cat([hidden, 50 * torch.randn(B, 2, H, generator=g)], 1)
    pad_t = torch.cat([teacher, torch.randn(B, 2, V, generator=g)], 1)
    pad_y = torch.cat([targets, torch.zeros(B, 2, dtype=torch.long)], 1)
    for chunk_size in (4, 5):
        plain = score_tokens(LMHead(hidden, weight, bias), targets, teacher=Logits(teacher),
                             top_k=4, teacher_top_k=5, chunk_size=chunk_size)
        padded = score_tokens(LMHead(pad_h, weight, bias), pad_y, teacher=Logits(pad_t),
                              top_k=4, teacher_top_k=5, chunk_size=chunk_size)
        for name in ("topk_ids", "teacher_topk_ids"):
            assert torch.equal(getattr(padded, name)[:, :T], getattr(plain, name)), name
        # the values are the same computation over other chunks: the head's GEMM sees other row
        # blocks (AVX2 and AVX-512 kernels then sum in other orders), so each log-prob may move
        # by a few ulps of the log-probs' magnitude (up to ~11 here), not by a fixed 1e-6
        for name in ("topk_logprobs", "teacher_logprobs_at_topk", "teacher_topk_logprobs",
                     "logprobs_at_ids"):
            assert_float_close(getattr(padded, name)[:, :T], getattr(plain, name), ulps=8,
                               name=name)


def test_gather_ids_equals_teacher_top_k_and_plain_gather() -> None:
    hidden, weight, bias, teacher, targets = _inputs(34)
    logits = hidden @ weight.T + bias
    via_teacher = score_tokens(Logits(logits), targets, teacher=Logits(teacher), teacher_top_k=4,
                               chunk_size=5)
    t_only = score_tokens(Logits(teacher), targets, top_k=4, chunk_size=3)  # a teacher pass
    assert torch.equal(t_only.topk_ids, via_teacher.teacher_topk_ids)
    assert torch.equal(t_only.topk_logprobs, via_teacher.teacher_topk_logprobs)
    given = score_tokens(Logits(logits), targets, gather_ids=t_only.topk_ids, chunk_size=4)
    assert torch.equal(given.logprobs_at_ids, via_teacher.logprobs_at_ids)
    ids = torch.randint(0, V, (B, T, 7), generator=torch.Generator().manual_seed(34))
    arbitrary = score_tokens(LMHead(hidden, weight, bias), targets, gather_ids=ids, chunk_size=2)
    _close(arbitrary.logprobs_at_ids,
           torch.log_softmax(logits.double(), -1).gather(-1, ids))
    assert arbitrary.topk_ids is None and arbitrary.teacher_topk_ids is None


def _topk_loss(scores, ups: list[torch.Tensor]) -> torch.Tensor:
    def get(name):
        return scores[name] if isinstance(scores, dict) else getattr(scores, name)

    return ((get("logprobs") * ups[0]).sum() + (get("topk_logprobs") * ups[1]).sum()
            + (get("logprobs_at_ids") * ups[2]).sum() + (get("kl") * ups[3]).sum())


@pytest.mark.parametrize("chunk_size", [1, 4, 22])
@pytest.mark.parametrize("temperature", [1.0, 1.3])
@pytest.mark.parametrize("mode", ["teacher_top_k", "gather_ids"])
def test_top_k_gradient_matches_float64_autograd(chunk_size: int, temperature: float,
                                                 mode: str) -> None:
    """d log p_i / du = onehot(i) - p for the top-k and gathered log-probs, combined with the
    target's and the KL's, against float64 autograd on the full logits (LM-head source)."""
    hidden, weight, bias, teacher, targets = _inputs(35)
    g = torch.Generator().manual_seed(35)
    k_s, k_t = 3, 4
    ups = [torch.randn(B, T, generator=g), torch.randn(B, T, k_s, generator=g),
           torch.randn(B, T, k_t, generator=g), torch.randn(B, T, generator=g)]
    t_ids = _topk_plain(teacher, teacher, 1, k_t)["teacher_topk_ids"]
    params = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    kw = ({"teacher_top_k": k_t} if mode == "teacher_top_k" else {"gather_ids": t_ids})
    scores = score_tokens(LMHead(*params), targets, teacher=Logits(teacher), top_k=k_s, kl=True,
                          chunk_size=chunk_size, temperature=temperature, **kw)
    _topk_loss(scores, ups).backward()

    ref = [t.double().requires_grad_(True) for t in (hidden, weight, bias)]
    z = ref[0] @ ref[1].T + ref[2]
    plain = _plain(z, targets, teacher.double(), temperature)
    logp = torch.log_softmax(z / temperature, dim=-1)
    s_ids = _ref_top_k(logp.detach(), k_s)[0]
    plain["topk_logprobs"] = logp.gather(-1, s_ids)
    plain["logprobs_at_ids"] = logp.gather(-1, t_ids)
    _topk_loss(plain, [u.double() for u in ups]).backward()
    for mine, theirs in zip(params, ref, strict=True):
        _close(mine.grad, theirs.grad)


def test_top_k_only_gradient_and_masked_gathered_id() -> None:
    """Only a gathered output carries upstream gradient (Logits source), one gathered id on a
    masked entry: the gradient is finite and equals autograd's."""
    hidden, weight, bias, _, targets = _inputs(36)
    base = (hidden @ weight.T + bias).detach()
    base[..., 5] = float("-inf")
    ids = torch.tensor([5, 0, 1]).expand(B, T, 3).clone()
    z = base.clone().requires_grad_(True)
    scores = score_tokens(Logits(z), targets, gather_ids=ids, chunk_size=4)
    assert torch.isneginf(scores.logprobs_at_ids[..., 0]).all()
    up = torch.randn(B, T, 3, generator=torch.Generator().manual_seed(36))
    (scores.logprobs_at_ids[..., 1:] * up[..., 1:]).sum().backward()
    z_ref = base.clone().requires_grad_(True)
    (torch.log_softmax(z_ref, -1).gather(-1, ids)[..., 1:] * up[..., 1:]).sum().backward()
    assert torch.isfinite(z.grad).all()
    _close(z.grad, z_ref.grad)


def test_top_k_outputs_constant_where_they_should_be() -> None:
    hidden, weight, _, teacher, targets = _inputs(37)
    z = (hidden @ weight.T).detach().requires_grad_(True)
    t_logits = teacher.clone()
    ref = weakref.ref(t_logits)
    scores = score_tokens(Logits(z), targets, teacher=Logits(t_logits), top_k=2,
                          teacher_top_k=3, chunk_size=4)
    for name in ("topk_ids", "teacher_logprobs_at_topk", "teacher_topk_ids",
                 "teacher_topk_logprobs"):
        assert not getattr(scores, name).requires_grad, name
    assert scores.topk_logprobs.requires_grad and scores.logprobs_at_ids.requires_grad
    del t_logits
    gc.collect()
    assert ref() is None  # the gathered gradient needs the ids only, not the teacher
    scores.logprobs_at_ids.sum().backward()
    assert z.grad is not None
    with torch.no_grad():
        off = score_tokens(Logits(z), targets, top_k=2, chunk_size=4)
    assert off.topk_logprobs.grad_fn is None


def test_top_k_empty_batch() -> None:
    z = torch.randn(2, 0, V, requires_grad=True)
    scores = score_tokens(Logits(z), torch.zeros(2, 0, dtype=torch.long),
                          teacher=Logits(torch.randn(2, 0, V)), top_k=3, teacher_top_k=2)
    assert scores.topk_ids.shape == (2, 0, 3) and scores.logprobs_at_ids.shape == (2, 0, 2)
    (scores.topk_logprobs.sum() + scores.logprobs_at_ids.sum()).backward()
    assert z.grad.shape == z.shape


def test_top_k_errors() -> None:
    _, _, _, teacher, targets = _inputs(38)
    src = Logits(teacher)
    with pytest.raises(ValueError, match=r"top_k must be an int in \[0, V\] with V = 37"):
        score_tokens(src, targets, top_k=V + 1)
    with pytest.raises(ValueError, match="top_k must be an int"):
        score_tokens(src, targets, top_k=-1)
    with pytest.raises(ValueError, match="teacher_top_k=4 needs a teacher"):
        score_tokens(src, targets, teacher_top_k=4)
    ids = torch.zeros(B, T, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="gather_ids and teacher_top_k"):
        score_tokens(src, targets, teacher=src, teacher_top_k=2, gather_ids=ids)
    with pytest.raises(ValueError, match=r"gather_ids must have shape \[B, T, K\]"):
        score_tokens(src, targets, gather_ids=ids[:, :-1])
    with pytest.raises(ValueError, match="gather_ids must be an integer"):
        score_tokens(src, targets, gather_ids=ids.float())
    with pytest.raises(ValueError, match=rf"gather_ids must be token ids in \[0, V\) with V = {V}"):
        score_tokens(src, targets, gather_ids=ids + V)


@pytest.mark.parametrize("chunk_size", [1, 5])
def test_memory_flat_with_top_k(chunk_size: int) -> None:
    """Top-k and gathered outputs, forward and backward, never allocate more than
    ``chunk_size`` rows of V (ties included: integer logits tie in nearly every row)."""
    hidden, weight, bias, _, targets = _inputs(39)
    params = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
    t_logits = torch.randint(0, 3, (B, T, V), generator=torch.Generator().manual_seed(39)).float()
    with _LargestVocabBlock(V) as mode:
        scores = score_tokens(LMHead(*params), targets, teacher=Logits(t_logits),
                              top_k=4, teacher_top_k=6, kl=True, chunk_size=chunk_size)
        (scores.topk_logprobs.sum() + scores.logprobs_at_ids.sum() + scores.kl.sum()).backward()
    assert mode.ops > 0 and mode.max_rows <= chunk_size
    assert all(p.grad is not None for p in params)
