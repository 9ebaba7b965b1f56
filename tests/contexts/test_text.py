"""Full and residual contexts: ids against hand-built ones (SmolLM2's and Qwen's templates), the
identical response in both contexts, and gathered log-probs equal to token-by-token scoring."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from saopd.choices import RESIDUAL_MODES
from saopd.contexts.batch import (
    Contexts,
    gather_response_logprobs,
    pad_contexts,
    response_positions,
)
from saopd.contexts.text import (
    build_contexts,
    collate_contexts,
    residual_messages,
    residual_start_token_id,
)
from saopd.models.loading import load_causal_lm
from saopd.models.pruning import prune_layers
from saopd.models.smollm2 import SMOLLM2_DEFAULT_SYSTEM
from saopd.models.tiny import tiny_llama, tiny_qwen3, tiny_tokenizer

NEUTRAL = "Please answer the question."
SYSTEM = "You are a careful math tutor."
QUESTION = "Alice has 3 apples and then 4 more. How many apples are there?"


@pytest.fixture(scope="module")
def smol_tok(smollm2_tok):
    return smollm2_tok


def _enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _turn(tok, role: str, content: str) -> list[int]:
    """<|im_start|>role\\ncontent<|im_end|>\\n built piece by piece."""
    s, e = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    return [s, *_enc(tok, f"{role}\n{content}"), e, *_enc(tok, "\n")]


def _gen_prompt(tok) -> list[int]:
    return [tok.convert_tokens_to_ids("<|im_start|>"), *_enc(tok, "assistant\n")]


def _msgs(system: bool) -> list[dict]:
    user = [{"role": "user", "content": QUESTION}]
    return [{"role": "system", "content": SYSTEM}, *user] if system else user


def _expected(tok, mode: str, system: bool, keep_system: bool, default_system: str | None):
    """Hand-built (full prefix, residual prefix) for a ChatML template."""

    def sys_turn(text: str | None) -> list[int]:
        return _turn(tok, "system", text) if text is not None else []

    full = sys_turn(SYSTEM if system else default_system) + _turn(tok, "user", QUESTION)
    full += _gen_prompt(tok)
    if mode == "response_only":
        return full, [residual_start_token_id(tok)]
    res_sys = SYSTEM if (system and keep_system) else default_system
    user = "" if mode == "empty_user" else NEUTRAL
    return full, sys_turn(res_sys) + _turn(tok, "user", user) + _gen_prompt(tok)


CASES = [(m, s, k) for m in RESIDUAL_MODES for s in (False, True) for k in (False, True)]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "system", "keep_system"), CASES)
def test_smollm2_contexts_match_hand_built_ids(smol_tok, mode, system, keep_system):
    tok = smol_tok
    response = [*_enc(tok, "3 + 4 = 7. The answer is 7."), tok.eos_token_id]
    ctx = build_contexts(tok, _msgs(system), response, residual=mode, keep_system=keep_system)
    full, res = _expected(tok, mode, system, keep_system, SMOLLM2_DEFAULT_SYSTEM)
    assert ctx.full_ids == full + response
    assert ctx.residual_ids == res + response
    assert (ctx.full_start, ctx.residual_start) == (len(full), len(res))
    assert ctx.response_ids == response == ctx.residual_ids[ctx.residual_start :]


def test_smollm2_template_default_system_stays_in_residual(smol_tok):
    ctx = build_contexts(smol_tok, _msgs(True), [42, 43])
    text = smol_tok.decode(ctx.residual_ids)
    assert text.startswith(f"<|im_start|>system\n{SMOLLM2_DEFAULT_SYSTEM}<|im_end|>\n")
    assert SYSTEM not in text and QUESTION not in text
    assert residual_start_token_id(smol_tok) == smol_tok.bos_token_id == 1


@pytest.mark.parametrize("which", ["tiny", "qwen"])
@pytest.mark.parametrize(("mode", "system", "keep_system"), CASES)
def test_qwen_style_contexts_match_hand_built_ids(
    which, tiny_tok, qwen_tok, mode, system, keep_system
):
    tok = tiny_tok if which == "tiny" else qwen_tok
    response = [*_enc(tok, "We compute 3 + 4 = 7."), tok.eos_token_id]
    ctx = build_contexts(tok, _msgs(system), response, residual=mode, keep_system=keep_system)
    full, res = _expected(tok, mode, system, keep_system, None)
    assert ctx.full_ids == full + response
    assert ctx.residual_ids == res + response
    assert (ctx.full_start, ctx.residual_start) == (len(full), len(res))


def test_qwen_literal_residual_ids(qwen_tok):
    # <|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n ; "\n" is rank 198, "user" 872,
    # "assistant" 77091 in qwen.tiktoken
    ctx = build_contexts(qwen_tok, _msgs(True), [9707])
    assert ctx.residual_ids == [151644, 872, 198, 151645, 198, 151644, 77091, 198, 9707]
    only = build_contexts(qwen_tok, _msgs(True), [9707], residual="response_only")
    assert only.residual_ids == [151643, 9707]  # no BOS in Qwen: <|endoftext|>


def test_chat_template_kwargs_reach_both_contexts(qwen_tok):
    ctx = build_contexts(
        qwen_tok, _msgs(False), [9707], chat_template_kwargs={"enable_thinking": False}
    )
    think = [151667, 271, 151668, 271]  # <think>\n\n</think>\n\n
    assert ctx.full_ids[ctx.full_start - 4 : ctx.full_start] == think
    assert ctx.residual_ids[ctx.residual_start - 4 : ctx.residual_start] == think


def test_multi_turn_history_is_dropped(tiny_tok):
    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": QUESTION},
    ]
    assert residual_messages(msgs, keep_system=True) == [msgs[0], {"role": "user", "content": ""}]
    assert residual_messages(msgs, "neutral_prompt") == [{"role": "user", "content": NEUTRAL}]
    assert residual_messages(msgs, "response_only") is None
    ctx = build_contexts(tiny_tok, msgs, [5, 6, 7])
    text = tiny_tok.decode(ctx.residual_ids)
    assert "first" not in text and QUESTION not in text
    assert "first answer" in tiny_tok.decode(ctx.full_ids)


def test_response_positions_and_contexts_properties():
    assert response_positions(5, 3) == [4, 5, 6]
    with pytest.raises(ValueError, match="start must be >= 1"):
        response_positions(0, 2)
    c = Contexts(full_ids=[1, 2, 3, 9, 8], residual_ids=[1, 9, 8], full_start=3, residual_start=1)
    assert c.response_ids == [9, 8] and c.response_len == 2
    assert c.full_positions == [2, 3] and c.residual_positions == [0, 1]


# ---------------------------------------------------------------------------------- batches


def _token_by_token(model, ids: list[int], start: int) -> list[float]:
    out = []
    for i in range(start, len(ids)):
        with torch.no_grad():
            logits = model(torch.tensor([ids[:i]])).logits[0, -1]
        out.append(float(logits.float().log_softmax(-1)[ids[i]]))
    return out


def _rows(tok):
    msgs = [
        _msgs(True),
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "user", "content": "Let x = 5. Then x/2 = ?"}],
    ]
    responses = [
        [*_enc(tok, "The answer is 7."), tok.eos_token_id],
        _enc(tok, "4"),
        torch.tensor([*_enc(tok, "We compute 5 / 2 = 2.5, so x/2 = 2.5."), tok.eos_token_id]),
    ]
    return msgs, responses


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("mode", RESIDUAL_MODES)
def test_gathered_logprobs_equal_token_by_token(tiny_tok, padding_side, mode):
    # float64: this checks positions and gathering, so batched-vs-single float32 rounding
    # (which BLAS may vary from run to run) must not decide the outcome
    model = tiny_qwen3(tiny_tok, layers=2, seed=3, initializer_range=0.2).double()
    msgs, responses = _rows(tiny_tok)
    batch = collate_contexts(tiny_tok, msgs, responses, residual=mode, padding_side=padding_side)
    b, r = batch.response_ids.shape
    assert (b, r) == (3, max(len(x) for x in responses))
    assert batch.response_mask.sum(1).tolist() == [len(x) for x in responses]
    contexts = [
        build_contexts(tiny_tok, m, x, residual=mode) for m, x in zip(msgs, responses, strict=True)
    ]
    for name in ("full", "residual"):
        cb = getattr(batch, name)
        assert cb.gather_index.shape == (b, r)
        with torch.no_grad():
            logits = model(**cb.model_inputs()).logits
        lp = gather_response_logprobs(
            logits, cb.gather_index, batch.response_ids, batch.response_mask
        )
        assert lp.shape == (b, r) and lp.dtype == torch.float32
        # labels-style: logits[:, :-1] against input_ids[:, 1:], gathered at gather_index
        shifted = logits[:, :-1].log_softmax(-1).gather(-1, cb.input_ids[:, 1:, None])[..., 0]
        lp2 = shifted.gather(1, cb.gather_index).masked_fill(~batch.response_mask, 0).float()
        torch.testing.assert_close(lp, lp2, atol=1e-5, rtol=0)
        for i, ctx in enumerate(contexts):
            ids = ctx.full_ids if name == "full" else ctx.residual_ids
            start = ctx.full_start if name == "full" else ctx.residual_start
            ref = torch.tensor(_token_by_token(model, ids, start))
            torch.testing.assert_close(lp[i, : len(ref)], ref, atol=1e-5, rtol=0)
            # the same response tokens sit at the gathered targets
            targets = cb.input_ids[i, cb.gather_index[i, : len(ref)] + 1]
            assert (
                targets.tolist() == ctx.response_ids == batch.response_ids[i, : len(ref)].tolist()
            )
            labels = cb.labels[i]
            assert labels[labels != -100].tolist() == ctx.response_ids
            assert int(cb.attention_mask[i].sum()) == len(ids) == int(cb.lengths[i])
        assert (lp[~batch.response_mask] == 0).all()
    assert batch.num_truncated == 0


def test_padding_layout(tiny_tok):
    msgs, responses = _rows(tiny_tok)
    right = collate_contexts(tiny_tok, msgs, responses, pad_to_multiple_of=8)
    left = collate_contexts(tiny_tok, msgs, responses, padding_side="left")
    assert right.full.input_ids.shape[1] % 8 == 0
    pad = tiny_tok.pad_token_id
    for cb in (right.full, right.residual):
        assert (cb.attention_mask[:, 0] == 1).all()
        assert (cb.input_ids[cb.attention_mask == 0] == pad).all()
        assert torch.equal(cb.position_ids[0], torch.arange(cb.input_ids.shape[1]))
    for cb in (left.full, left.residual):
        assert (cb.attention_mask[:, -1] == 1).all()
        first_real = (cb.attention_mask == 1).int().argmax(1)
        assert (cb.position_ids.gather(1, first_real[:, None]) == 0).all()
    assert right.padding_side == "right" and left.padding_side == "left"


@pytest.mark.slow
def test_smollm2_batch_logprobs(smollm2_dir, smol_tok):
    model = prune_layers(load_causal_lm(smollm2_dir), every=10)
    msgs = [_msgs(True), [{"role": "user", "content": "What is 2+2?"}]]
    responses = [_enc(smol_tok, "7 apples."), [*_enc(smol_tok, "4"), smol_tok.eos_token_id]]
    batch = collate_contexts(smol_tok, msgs, responses)
    # SmolLM2's pad id is its EOS: masks must come from lengths, not from pad ids
    assert smol_tok.pad_token_id == smol_tok.eos_token_id
    assert len(responses[0]) > 2
    assert batch.response_mask[1].tolist() == [True, True] + [False] * (len(responses[0]) - 2)
    for i, (m, resp) in enumerate(zip(msgs, responses, strict=True)):
        ctx = build_contexts(smol_tok, m, resp)
        for name, ids, start in (
            ("full", ctx.full_ids, ctx.full_start),
            ("residual", ctx.residual_ids, ctx.residual_start),
        ):
            cb = getattr(batch, name)
            with torch.no_grad():
                logits = model(**cb.model_inputs()).logits
            lp = gather_response_logprobs(logits, cb.gather_index, batch.response_ids)
            ref = torch.tensor(_token_by_token(model, ids, start))
            torch.testing.assert_close(lp[i, : len(resp)], ref, atol=1e-4, rtol=0)


def test_truncation(tiny_tok):
    msgs, responses = _rows(tiny_tok)
    contexts = [build_contexts(tiny_tok, m, r) for m, r in zip(msgs, responses, strict=True)]
    lengths = [len(c.full_ids) for c in contexts]
    max_length = sorted(lengths)[1]  # the longest row must be cut
    long_row = lengths.index(max(lengths))
    with pytest.raises(ValueError, match=rf"row {long_row}: the full context has {max(lengths)}"):
        collate_contexts(tiny_tok, msgs, responses, max_length=max_length)
    batch = collate_contexts(tiny_tok, msgs, responses, max_length=max_length,
                             truncation="truncate")
    assert long_row in batch.truncated_rows and batch.num_truncated == len(batch.truncated_rows)
    assert batch.full.input_ids.shape[1] <= max_length
    cb, ctx = batch.full, contexts[long_row]
    kept = cb.input_ids[long_row][cb.attention_mask[long_row].bool()].tolist()
    assert kept == ctx.full_ids[-max_length:]  # prompt cut from the left, response intact
    assert kept[int(cb.starts[long_row]) :] == ctx.response_ids
    model = tiny_llama(tiny_tok, seed=1, initializer_range=0.2)
    with torch.no_grad():
        logits = model(**cb.model_inputs()).logits
    lp = gather_response_logprobs(logits, cb.gather_index, batch.response_ids)
    ref = torch.tensor(_token_by_token(model, kept, int(cb.starts[long_row])))
    torch.testing.assert_close(lp[long_row, : len(ref)], ref, atol=1e-5, rtol=0)

    longest_response = max(len(c.response_ids) for c in contexts)
    with pytest.raises(ValueError, match="responses are never truncated"):
        collate_contexts(tiny_tok, msgs, responses, max_length=longest_response,
                         truncation="truncate")


def test_errors(tiny_tok):
    msgs, responses = _rows(tiny_tok)
    with pytest.raises(ValueError, match="row 1 is empty"):
        collate_contexts(tiny_tok, msgs, [responses[0], [], responses[2]])
    with pytest.raises(ValueError, match="response_ids is empty"):
        build_contexts(tiny_tok, msgs[0], [])
    with pytest.raises(
        ValueError, match=r"residual must be one of \['empty_user', 'response_only'"
    ):
        build_contexts(tiny_tok, msgs[0], [5], residual="no_input")
    with pytest.raises(ValueError, match="residual must be one of"):
        collate_contexts(tiny_tok, msgs, responses, residual="bogus")
    with pytest.raises(ValueError, match="truncation must be one of"):
        collate_contexts(tiny_tok, msgs, responses, truncation="right")
    with pytest.raises(ValueError, match="padding_side must be one of"):
        collate_contexts(tiny_tok, msgs, responses, padding_side="middle")
    with pytest.raises(ValueError, match="3 rows but responses has 2"):
        collate_contexts(tiny_tok, msgs, responses[:2])
    with pytest.raises(ValueError, match="1-D integer tensor"):
        build_contexts(tiny_tok, msgs[0], torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="messages of row 0 is empty"):
        collate_contexts(tiny_tok, [[]], [[5]])
    with pytest.raises(ValueError, match="contexts is empty"):
        pad_contexts([], pad_token_id=0)
    no_template = tiny_tokenizer()
    no_template.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        build_contexts(no_template, msgs[0], [5])


def test_teacher_contexts_are_built_for_text_pairs_only() -> None:
    from saopd.contexts import context_builder
    from saopd.models.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match="text pairs only"):
        context_builder(tok, object(), teacher_tokenizer=tok)
    builder = context_builder(tok, teacher_tokenizer=tok, response_id_map={2: 0})
    assert builder.teacher_tokenizer is tok and builder.response_id_map == {2: 0}
