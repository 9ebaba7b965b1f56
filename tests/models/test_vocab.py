"""The graded teacher/student tokenizer check (saopd.models.vocab): which kind of pair it is
(same / template_differs / specials_differ), what it refuses, and the response id map."""

from __future__ import annotations

import copy
import json
import warnings

import pytest

from saopd.models.tiny import tiny_qwen3, tiny_tokenizer
from saopd.models.vocab import PROBE_TEXTS, check_vocabularies
from tests.helpers.tokenizer_pairs import DEEPSEEK_RENAMED, deepseek_style_tokenizer


def test_same_vocabulary_passes_and_reports(tiny_tok):
    student = tiny_qwen3(tiny_tok)
    teacher = tiny_qwen3(tiny_tok, layers=3, vocab_size=len(tiny_tok))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = check_vocabularies(tiny_tok, tiny_tokenizer(), student, teacher)
    assert report.vocab_size == len(tiny_tok)
    assert report.common_logits == len(tiny_tok) and report.warnings == ()
    assert report.kind == "same" and not report.teacher_contexts
    assert report.response_id_map == {} and report.renamed_specials == ()
    assert report.probes == len(PROBE_TEXTS)


def test_different_vocabularies_are_refused(tiny_tok, qwen_tok):
    with pytest.raises(ValueError, match="do not share a vocabulary") as info:
        check_vocabularies(tiny_tok, qwen_tok)
    msg = str(info.value)
    assert f"student has {len(tiny_tok)} tokens, teacher 151669" in msg
    assert "first differing ids: id 0" in msg


def test_different_special_tokens_are_refused(tiny_tok):
    base = tiny_tokenizer()
    base.eos_token = "<|endoftext|>"  # a Base student with an Instruct teacher
    with pytest.raises(ValueError, match=r"eos: student '<\|endoftext\|>' \(id 0\)"):
        check_vocabularies(base, tiny_tok)
    padded = tiny_tokenizer()
    padded.pad_token = "<|endoftext|>"
    with pytest.raises(ValueError, match="pad"):
        check_vocabularies(padded, tiny_tok)


def test_a_different_chat_template_makes_the_teacher_score_its_own_contexts(tiny_tok):
    other = tiny_tokenizer()
    other.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no longer a warning: the teacher's template is used
        report = check_vocabularies(tiny_tok, other)
    assert report.kind == "template_differs" and report.teacher_contexts
    assert report.response_id_map == {}  # same vocabulary and specials: nothing to map
    (note,) = report.warnings
    assert "its own chat template" in note
    assert "{% for m in messages %}{{ m.content }}{% endfor %}" in note  # the teacher's
    assert repr(" ".join(tiny_tok.chat_template.split())[:60])[1:-1] in note  # the student's


def test_a_deepseek_style_teacher_is_specials_differ_with_the_eos_mapped(qwen_tok):
    teacher = deepseek_style_tokenizer()
    report = check_vocabularies(qwen_tok, teacher)
    assert report.kind == "specials_differ" and report.teacher_contexts
    renamed = {i: (s, t) for i, s, t in report.renamed_specials}
    assert set(renamed) == set(DEEPSEEK_RENAMED)
    assert renamed[151645] == ("<|im_end|>", "<｜Assistant｜>")
    # Qwen3 ends a turn with <|im_end|> (151645), which the teacher reads as <｜Assistant｜>:
    # a response's last token must become the teacher's EOS <｜end▁of▁sentence｜> (151643)
    assert report.response_id_map == {151645: 151643}
    # <think> (151667) has the same name and id on both sides: not mapped
    assert teacher.convert_ids_to_tokens(151667) == qwen_tok.convert_ids_to_tokens(151667)
    assert "specials_differ" in report.describe()


def test_text_that_tokenizes_differently_is_refused(qwen_tok):
    from tokenizers import Tokenizer, normalizers
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(qwen_tok.backend_tokenizer.to_str())
    backend = Tokenizer.from_str(json.dumps(spec))
    backend.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
    lower = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                    pad_token="<|endoftext|>",
                                    chat_template=qwen_tok.chat_template)
    with pytest.raises(ValueError, match=r"tokenize ordinary text differently.*probe text 0"):
        check_vocabularies(qwen_tok, lower)
    # the probe corpus is the caller's to choose: lower-case text alone cannot tell them apart
    report = check_vocabularies(qwen_tok, lower, probe_texts=["only lower case 12 + 3"])
    assert report.probes == 1


def test_model_output_sizes(tiny_tok):
    n = len(tiny_tok)
    small = tiny_qwen3(tiny_tok)
    padded = tiny_qwen3(tiny_tok, vocab_size=n + 64)
    with pytest.warns(UserWarning, match="output vocabularies differ"):
        report = check_vocabularies(tiny_tok, tiny_tok, small, padded)
    assert (report.student_logits, report.teacher_logits, report.common_logits) == (n, n + 64, n)
    too_small = tiny_qwen3(tiny_tok)
    too_small.resize_token_embeddings(n - 10)
    with pytest.raises(ValueError, match=f"teacher model outputs {n - 10} logits"):
        check_vocabularies(tiny_tok, copy.deepcopy(tiny_tok), small, too_small)
