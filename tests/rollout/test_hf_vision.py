"""HF generate with images: a left-padded mixed batch (image, two images, text only) samples what
each prompt alone samples, rollouts carry the expanded prompt, and the sampler's log-probs equal
the teacher-forced log-probs of the training contexts (same 3D positions in both)."""

from __future__ import annotations

import pytest
import torch

from saopd.contexts.vision import collate_vision_contexts
from saopd.prompts.render import render_prompt_ids
from saopd.prompts.vision import encode_prompt
from saopd.rollout import HFGenerateEngine, SamplingParams
from tests.helpers.vlm import chats, teacher_forced, tiny_pair


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", "qwen3_5"])
def test_batched_image_rollouts_match_single_prompts_and_scoring(kind: str) -> None:
    model, proc = tiny_pair(kind)
    engine = HFGenerateEngine(model, proc.tokenizer, processor=proc, greedy=True)
    sampling = SamplingParams(n=2, max_new_tokens=6, seed=0)
    batch = engine.generate(chats(), sampling)
    assert [r.prompt_index for r in batch.rollouts] == [0, 0, 1, 1, 2, 2]
    for j, chat in enumerate(chats()):
        expanded = encode_prompt(proc, chat).ids
        assert batch.rollouts[2 * j].prompt_ids == expanded
        alone = engine.generate([chat], SamplingParams(n=1, max_new_tokens=6, seed=0))
        assert alone.rollouts[0].response_ids == batch.rollouts[2 * j].response_ids
    image_tokens = [sum(t == proc.image_token_id for t in r.prompt_ids) for r in batch.rollouts]
    assert image_tokens[0] > 0 and image_tokens[2] > image_tokens[0] and image_tokens[4] == 0

    lp, sampler = teacher_forced(model, proc, batch)
    torch.testing.assert_close(lp, sampler, atol=1e-5, rtol=1e-5)


def test_sampled_rollouts_with_images_are_seeded() -> None:
    model, proc = tiny_pair("qwen2_vl")
    engine = HFGenerateEngine(model, proc.tokenizer, processor=proc)
    sampling = SamplingParams(n=2, max_new_tokens=8, seed=7)
    a, b = engine.generate(chats()[:2], sampling), engine.generate(chats()[:2], sampling)
    assert [r.response_ids for r in a.rollouts] == [r.response_ids for r in b.rollouts]
    assert all(1 <= len(r.response_ids) <= 8 for r in a.rollouts)


def test_text_only_prompts_and_engines_without_processor_are_unchanged() -> None:
    model, proc = tiny_pair("qwen2_vl")
    text_chat = chats()[2]
    plain = HFGenerateEngine(model, proc.tokenizer, greedy=True)
    with_proc = HFGenerateEngine(model, proc.tokenizer, greedy=True, processor=proc)
    assert with_proc.prompt_ids(text_chat) == render_prompt_ids(proc.tokenizer, text_chat)
    s = SamplingParams(n=1, max_new_tokens=5, seed=0)
    assert plain.generate([text_chat], s).rollouts[0].response_ids == \
        with_proc.generate([text_chat], s).rollouts[0].response_ids


def test_truncation_never_cuts_an_image_and_bad_processors_are_refused() -> None:
    model, proc = tiny_pair("qwen2_vl")
    n = len(encode_prompt(proc, chats()[0]).ids)
    engine = HFGenerateEngine(model, proc.tokenizer, processor=proc, max_prompt_length=n - 8,
                              prompt_truncation="truncate")
    with pytest.raises(ValueError, match=r"prompt 0 has \d+ tokens .*would cut into an image"):
        engine.generate(chats()[:1], SamplingParams(max_new_tokens=2))
    skip = HFGenerateEngine(model, proc.tokenizer, processor=proc, max_prompt_length=n - 8,
                            prompt_truncation="skip")
    assert skip.generate(chats()[:1], SamplingParams(max_new_tokens=2)).num_skipped_prompts == 1
    from saopd.models.tiny_vlm import tiny_vlm_tokenizer

    with pytest.raises(ValueError, match=r"the processor's tokenizer must be the engine's"):
        HFGenerateEngine(model, tiny_vlm_tokenizer(), processor=proc)
    with pytest.raises(ValueError, match=r"prompt 0 holds images but the engine has no "
                                         r"processor"):
        HFGenerateEngine(model, proc.tokenizer).generate(chats()[:1], SamplingParams())


def test_vision_tokens_are_never_sampled_and_logprobs_stay_raw() -> None:
    """A random tiny VLM puts ~0.4% of its mass on the four vision special tokens: unsuppressed,
    64 rows x 24 tokens would sample several. None may appear, and the recorded log-probs are
    still those of the raw distribution (the suppression runs after the recorder)."""
    from saopd.models.vlm import vision_token_ids

    model, proc = tiny_pair("qwen2_vl")
    vision = {t for t in vision_token_ids(proc).values() if t is not None}
    engine = HFGenerateEngine(model, proc.tokenizer, processor=proc)
    batch = engine.generate(chats(), SamplingParams(n=21, max_new_tokens=24, seed=1))
    sampled = [t for r in batch.rollouts for t in r.response_ids]
    assert len(sampled) > 1000 and vision.isdisjoint(sampled)
    raw = HFGenerateEngine(model, proc.tokenizer)  # no processor: no suppression
    text = raw.generate([chats()[2]] * 4, SamplingParams(n=16, max_new_tokens=24, seed=1))
    assert not vision.isdisjoint(t for r in text.rollouts for t in r.response_ids)
    lp, sampler = teacher_forced(model, proc, batch, rows=6)
    torch.testing.assert_close(lp, sampler, atol=1e-5, rtol=1e-5)


def test_a_response_holding_vision_tokens_is_refused_naming_the_row() -> None:
    _, proc = tiny_pair("qwen2_vl")
    pad = proc.image_token_id
    with pytest.raises(ValueError, match=rf"row 1: the response holds vision special token ids "
                                         rf"\[{pad}\]"):
        collate_vision_contexts(proc, chats()[:2], [[5, 6], [7, pad, 8]])
