"""VLM contexts: residual variants (all / image / text), identical response ids, gather positions
after image expansion, and teacher full-context logits equal to a plain forward (3D M-RoPE
computed by the model itself) for Qwen2-VL, Qwen3-VL and Qwen3.5."""

from __future__ import annotations

import pytest
import torch

from saopd.contexts.text import collate_contexts
from saopd.contexts.vision import VisionInputs, collate_vision_contexts, vision_residual_messages
from saopd.prompts.vision import encode_prompt, message_images
from saopd.scoring.passes import response_source
from saopd.signals import LMHead
from tests.helpers.vlm import KINDS, chats, tiny_pair

RESPONSES = [[11, 12, 13], [14, 15, 16, 17, 18], [19]]


def _logits(src: LMHead) -> torch.Tensor:
    return src.hidden @ src.weight.T  # [B, R, V]


def _image_tokens(processor, ids: torch.Tensor) -> int:
    return int((ids == processor.image_token_id).sum())


@pytest.mark.parametrize("remove", ["all", "image", "text"])
def test_residual_variants_keep_the_response_and_drop_what_they_say(remove: str) -> None:
    _, proc = tiny_pair("qwen2_vl")
    batch = collate_vision_contexts(proc, chats(), RESPONSES, remove=remove)
    tok = proc.tokenizer
    for b, resp in enumerate(RESPONSES):
        for ctx in (batch.full, batch.residual):
            start, n = int(ctx.starts[b]), int(ctx.lengths[b])
            assert ctx.input_ids[b, start:n].tolist() == resp  # the identical response ids
            # the positions gathered predict exactly the response tokens
            assert ctx.input_ids[b, ctx.gather_index[b, :len(resp)] + 1].tolist() == resp
        full_prompt = batch.full.input_ids[b, :int(batch.full.starts[b])]
        res_prompt = batch.residual.input_ids[b, :int(batch.residual.starts[b])]
        n_images = len(message_images(chats()[b]))
        full_text, res_text = tok.decode(full_prompt), tok.decode(res_prompt)
        question = {0: "How many circles", 1: "Compare the colours", 2: "What is 3 + 4"}[b]
        assert question in full_text and (_image_tokens(proc, full_prompt) > 0) == (n_images > 0)
        if remove == "all":
            assert _image_tokens(proc, res_prompt) == 0 and question not in res_text
        elif remove == "image":
            assert _image_tokens(proc, res_prompt) == 0 and question in res_text
        else:  # text removed, images kept with all their tokens
            assert _image_tokens(proc, res_prompt) == _image_tokens(proc, full_prompt)
            assert question not in res_text
        assert "Answer briefly" not in res_text  # the caller's system turn is task input
    assert torch.equal(batch.response_ids[batch.response_mask],
                       torch.tensor([t for r in RESPONSES for t in r]))
    assert batch.full.vision.num_images == 3
    assert batch.residual.vision.num_images == (3 if remove == "text" else 0)
    assert batch.residual.model_inputs().keys() >= {"input_ids", "attention_mask",
                                                    "mm_token_type_ids"}
    assert ("pixel_values" in batch.residual.model_inputs()) == (remove == "text")
    assert "position_ids" not in batch.full.model_inputs()  # the model builds 3D positions


def test_all_residual_is_the_text_residual_token_for_token() -> None:
    _, proc = tiny_pair("qwen2_vl")
    vis = collate_vision_contexts(proc, chats(), RESPONSES, remove="all")
    text = collate_contexts(proc.tokenizer, chats(), RESPONSES)
    assert torch.equal(vis.residual.input_ids, text.residual.input_ids)
    assert torch.equal(vis.residual.gather_index, text.residual.gather_index)


def test_residual_message_variants_and_refusals() -> None:
    msgs = chats()[1]
    assert vision_residual_messages(msgs, "image") == [
        {"role": "user", "content": "Compare the colours"}]
    kept = vision_residual_messages(msgs, "text", residual="neutral_prompt", keep_system=True)
    assert kept[0] == {"role": "system", "content": "Answer briefly."}
    assert [p["type"] for p in kept[1]["content"]] == ["image", "image", "text"]
    assert vision_residual_messages(msgs, "all") == [{"role": "user", "content": ""}]
    with pytest.raises(ValueError, match=r"response_only.*cannot keep the images"):
        vision_residual_messages(msgs, "text", residual="response_only")
    with pytest.raises(ValueError, match=r"remove must be one of \['all', 'image', 'text'\]"):
        vision_residual_messages(msgs, "pixels")


@pytest.mark.parametrize("kind", KINDS)
def test_full_context_logits_equal_a_plain_forward(kind: str) -> None:
    model, proc = tiny_pair(kind)
    batch = collate_vision_contexts(proc, chats(), RESPONSES, remove="text")
    with torch.no_grad():
        got = {"full": _logits(response_source(model, batch.full)),
               "residual": _logits(response_source(model, batch.residual))}
    tok = proc.tokenizer
    for b, resp in enumerate(RESPONSES):
        for which, msgs in (("full", chats()[b]),
                            ("residual", vision_residual_messages(chats()[b], "text"))):
            # independent path: the template text through the processor's own __call__
            text = tok.apply_chat_template(msgs, chat_template=proc.chat_template,
                                           tokenize=False, add_generation_prompt=True)
            images = message_images(msgs)
            enc = proc(text=[text], images=images or None, return_tensors="pt",
                       add_special_tokens=False)
            prompt = enc["input_ids"][0].tolist()
            ids = torch.tensor([prompt + resp])
            kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            if images:
                kw.update(pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"],
                          mm_token_type_ids=(ids == proc.image_token_id).long())
            with torch.no_grad():
                ref = model(**kw).logits[0, len(prompt) - 1: len(prompt) - 1 + len(resp)]
            torch.testing.assert_close(got[which][b, :len(resp)], ref, atol=1e-5, rtol=1e-5)


def test_rope_is_3d_not_1d() -> None:
    """Forcing 1D positions changes the logits after an image: the contexts must not pass them."""
    model, proc = tiny_pair("qwen2_vl")
    batch = collate_vision_contexts(proc, chats()[:1], RESPONSES[:1])
    with torch.no_grad():
        good = model(**batch.full.model_inputs()).logits
        flat = model(**batch.full.model_inputs(), position_ids=batch.full.position_ids).logits
    assert (good - flat).abs().max() > 1e-3


def test_micro_batch_slices_carry_their_own_images() -> None:
    model, proc = tiny_pair("qwen2_vl")
    batch = collate_vision_contexts(proc, chats(), RESPONSES, remove="text")
    with torch.no_grad():
        whole = _logits(response_source(model, batch.full))
        for rows in (slice(0, 1), slice(1, 3), slice(2, 3)):
            part = batch.rows(rows)
            n_img = sum(len(message_images(m)) for m in chats()[rows])
            assert part.full.vision.num_images == n_img
            sub = _logits(response_source(model, part.full))
            torch.testing.assert_close(sub, whole[rows][:, :sub.shape[1]], atol=1e-5, rtol=1e-5)
    empty = VisionInputs.from_prompts([None, None])
    assert empty[0:1].num_images == 0 and empty.model_inputs() == {}
    with pytest.raises(TypeError, match="contiguous rows"):
        batch.full.vision[::2]


def test_truncation_never_cuts_an_image_and_prompt_ids_are_checked() -> None:
    _, proc = tiny_pair("qwen2_vl")
    msgs, resp = chats()[:1], RESPONSES[:1]
    n = len(encode_prompt(proc, msgs[0]).ids) + len(resp[0])
    with pytest.raises(ValueError, match=r"row 0: the full context .*cut into an image"):
        collate_vision_contexts(proc, msgs, resp, max_length=n - 8, truncation="truncate")
    cut = collate_vision_contexts(proc, msgs, resp, max_length=n - 2, truncation="truncate")
    assert cut.truncated_rows == (0,) and cut.full.vision.num_images == 1  # text cut only
    drop_image = [t for t in encode_prompt(proc, msgs[0]).ids if t != proc.image_token_id]
    with pytest.raises(ValueError, match=r"row 0: the rollout's prompt has 0 image tokens"):
        collate_vision_contexts(proc, msgs, resp, prompt_ids=[drop_image])


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen3_5"])
def test_prompt_length_counts_image_tokens_without_decoding_pixels(kind: str) -> None:
    from saopd.prompts.text import PromptRecord
    from saopd.prompts.vision import filter_long_vision_prompts, prompt_length

    _, proc = tiny_pair(kind)
    lengths = [len(encode_prompt(proc, c).ids) for c in chats()]
    assert [prompt_length(proc, c) for c in chats()] == lengths
    records = [PromptRecord(str(i), c, None, "t") for i, c in enumerate(chats())]
    limit = sorted(lengths)[1]  # keeps the two shortest prompts
    kept, skipped = filter_long_vision_prompts(records, proc, limit)
    assert skipped == 1 and [r.id for r in kept] == [str(i) for i, n in enumerate(lengths)
                                                     if n <= limit]
    with pytest.raises(ValueError, match=r"1 of 3 prompts exceed max_prompt_length .* with "
                                         r"their image tokens"):
        filter_long_vision_prompts(records, proc, limit, mode="error")


def test_a_vision_prompt_with_megabytes_of_text_is_too_long_without_tokenizing() -> None:
    from saopd.prompts.text import PromptRecord, prompt_char_limit
    from saopd.prompts.vision import filter_long_vision_prompts

    _, proc = tiny_pair("qwen2_vl")
    limit = 64
    text = "x" * (prompt_char_limit(proc.tokenizer, limit * 100) + 1)
    huge = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    records = [PromptRecord("huge", huge, None, "t"),
               *(PromptRecord(str(i), c, None, "t") for i, c in enumerate(chats()))]
    kept, skipped = filter_long_vision_prompts(records, proc, limit * 100)
    assert skipped == 1 and "huge" not in [r.id for r in kept] and len(kept) == len(chats())
    # the error names it as measured in characters: the tokenizer never saw it
    with pytest.raises(ValueError, match=r"'huge' with [\d,]+ characters of text, not tok"):
        filter_long_vision_prompts(records, proc, limit * 100, mode="error")


def test_unexpanded_prompt_text_for_vllm_has_one_placeholder_per_image() -> None:
    from saopd.prompts.vision import render_prompt_text

    _, proc = tiny_pair("qwen2_vl")
    for chat in chats():
        text = render_prompt_text(proc, chat)
        assert text.count("<|image_pad|>") == len(message_images(chat))
        enc = proc(text=[text], images=message_images(chat) or None, return_tensors="pt",
                   add_special_tokens=False)
        assert enc["input_ids"][0].tolist() == encode_prompt(proc, chat).ids
