"""Processors: PIL only; teacher/student disagreement (token ids, patch/merge sizes, pixel limits,
chat template) is refused with what differs; a model must match its processor; offline loading
of a saved checkpoint folder through AutoModelForImageTextToText."""

from __future__ import annotations

from pathlib import Path

import pytest

from saopd.config.model import ModelConfig
from saopd.models.factory import build_model, build_vlm
from saopd.models.tiny import tiny_qwen3, tiny_tokenizer
from saopd.models.tiny_vlm import tiny_vlm, tiny_vlm_processor, tiny_vlm_tokenizer
from saopd.models.vlm import (
    QWEN_VL_CHAT_TEMPLATE,
    check_model_matches_processor,
    check_same_processor,
    load_vlm,
    load_vlm_processor,
)
from tests.helpers.vlm import tiny_pair


def _proc(kind: str = "qwen2_vl", tokenizer: str = "tiny", **pixels):
    return tiny_vlm_processor(tiny_vlm_tokenizer(tokenizer), kind=kind, **pixels)


def test_processors_use_the_pil_image_processor_and_agree_with_themselves() -> None:
    a, b = _proc(), _proc()
    assert type(a.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert not hasattr(a, "video_processor") or a.video_processor is None
    report = check_same_processor(a, b)
    assert (report.patch_size, report.merge_size, report.temporal_patch_size) == (14, 2, 2)
    assert report.image_token_id == a.tokenizer.convert_tokens_to_ids("<|image_pad|>")


@pytest.mark.parametrize(
    ("teacher", "match"),
    [
        (lambda: _proc(max_pixels=28 * 28 * 64), r"max_pixels \(size.longest_edge\): student "
                                                 r"12544 vs teacher 50176"),
        (lambda: _proc("qwen3_5"), r"patch_size: student 14 vs teacher 16"),
        (lambda: _proc(tokenizer="qwen"), r"image token id: student \d+ vs teacher 151655"),
    ],
)
def test_mismatched_processors_are_refused(teacher, match: str) -> None:
    with pytest.raises(ValueError, match=r"student and teacher processors differ.*" + match):
        check_same_processor(_proc(), teacher())


def test_a_different_chat_template_is_refused() -> None:
    other = _proc()
    other.chat_template = QWEN_VL_CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|>",
                                                        "Picture: <|vision_start|><|image_pad|>")
    with pytest.raises(ValueError, match=r"chat template: a probe conversation renders to "
                                         r"different ids"):
        check_same_processor(_proc(), other)


def test_a_model_must_match_its_processor() -> None:
    model, proc = tiny_pair("qwen2_vl")
    check_model_matches_processor(model, proc)
    with pytest.raises(ValueError, match=r"the teacher does not match the processor: "
                                         r".*vision_config.patch_size = 14 but the image "
                                         r"processor's patch_size is 16"):
        check_model_matches_processor(model, _proc("qwen3_5"), role="teacher")
    qwen_proc = _proc(tokenizer="qwen")
    with pytest.raises(ValueError, match=r"config.image_token_id = \d+ but the processor's "
                                         r"image token is 151655"):
        check_model_matches_processor(model, qwen_proc)


def test_model_config_for_vlms() -> None:
    cfg = ModelConfig(tiny="qwen3_5", max_pixels=32 * 32 * 8)
    assert cfg.is_vision and not ModelConfig(tiny="qwen3").is_vision
    model, proc = build_vlm(cfg)
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    assert proc.image_processor.size["longest_edge"] == 32 * 32 * 8
    assert build_model(cfg)[1].get_vocab() == proc.tokenizer.get_vocab()
    with pytest.raises(ValueError, match=r"min_pixels / max_pixels apply to vision-language"):
        ModelConfig(tiny="qwen3", max_pixels=100)
    with pytest.raises(ValueError, match=r"tiny='llama' is a text model but model.vision"):
        ModelConfig(tiny="llama", vision=True)
    with pytest.raises(ValueError, match=r"build_vlm needs a vision-language model config"):
        build_vlm(ModelConfig(tiny="qwen3"))


def test_saved_checkpoint_folder_loads_offline(tmp_path: Path) -> None:
    tok = tiny_vlm_tokenizer()
    model = tiny_vlm(tok, kind="qwen3_vl", seed=3)
    proc = tiny_vlm_processor(tok, kind="qwen3_vl")
    model.save_pretrained(tmp_path / "m")
    proc.save_pretrained(tmp_path / "m")
    loaded = load_vlm(tmp_path / "m")
    assert type(loaded).__name__ == "Qwen3VLForConditionalGeneration"
    loaded_proc = load_vlm_processor(tmp_path / "m", max_pixels=32 * 32 * 4)
    assert type(loaded_proc.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert loaded_proc.image_processor.size["longest_edge"] == 32 * 32 * 4
    assert loaded_proc.image_processor.patch_size == 16
    assert loaded_proc.chat_template == proc.chat_template
    check_model_matches_processor(loaded, loaded_proc)
    # a text-only checkpoint is refused with the supported families
    text_tok = tiny_tokenizer()
    tiny_qwen3(text_tok).save_pretrained(tmp_path / "t")
    text_tok.save_pretrained(tmp_path / "t")
    with pytest.raises(ValueError, match=r"is a 'qwen3' model; vision-language training "
                                         r"supports the Qwen-VL families"):
        load_vlm_processor(tmp_path / "t")
