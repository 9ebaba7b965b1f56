"""Shared helpers of the vision-language tests: tiny models and processors (cached per process),
a small rendered dataset, hand-made images."""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from PIL import Image

from saopd.models.tiny_vlm import tiny_vlm, tiny_vlm_processor, tiny_vlm_tokenizer
from saopd.stages.synth_vqa import prepare_vlm

KINDS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")


@functools.cache
def tiny_pair(kind: str = "qwen2_vl", layers: int = 2, seed: int = 0) -> tuple[Any, Any]:
    """(model, processor) of a tiny VLM; shared across tests, so never train it in place."""
    tok = tiny_vlm_tokenizer()
    processor = tiny_vlm_processor(tok, kind=kind)
    return tiny_vlm(tok, kind=kind, layers=layers, seed=seed), processor


@functools.lru_cache(maxsize=1)
def synth_dir() -> Path:
    """A small ``prepare_vlm`` output (train 12 rows, test 6) in a per-process temp folder."""
    root = Path(tempfile.mkdtemp(prefix="saopd-vlm-"))
    prepare_vlm({"prepare_vlm": {"out_dir": str(root / "vlm"), "seed": 0, "image_size": 112,
                                 "splits": {"train": 12, "test": 6}}})
    return root / "vlm"


def solid(colour: tuple[int, int, int], size: tuple[int, int] = (224, 160)) -> Image.Image:
    img = Image.new("RGB", size, colour)
    for x in range(0, size[0], 7):  # some structure, so patches differ
        img.putpixel((x, (x * 3) % size[1]), (255 - colour[0], colour[1], 255 - colour[2]))
    return img


def chats() -> list[list[dict[str, Any]]]:
    """Three prompts: one image + question, a system turn + two images, and text only."""
    red, blue = solid((200, 30, 30)), solid((30, 30, 200), (96, 200))
    return [
        [{"role": "user", "content": [{"type": "image", "image": red},
                                      {"type": "text", "text": "How many circles are there?"}]}],
        [{"role": "system", "content": "Answer briefly."},
         {"role": "user", "content": [{"type": "text", "text": "Compare the colours"},
                                      {"type": "image", "image": red},
                                      {"type": "image", "image": blue}]}],
        [{"role": "user", "content": "What is 3 + 4?"}],
    ]


def teacher_forced(model: Any, proc: Any, batch: Any, rows: int | None = None
                   ) -> tuple[Any, Any]:
    """(the model's log-probs of the sampled tokens, the sampler's), over the valid response
    tokens of the first ``rows`` rollouts (all by default), scored in the training contexts
    (same pixel values, 3D positions computed by the model)."""
    import torch

    from saopd.contexts.vision import collate_vision_contexts

    rollouts = batch.rollouts[:rows]
    ctx = collate_vision_contexts(proc, batch.row_messages()[:rows],
                                  [r.response_ids for r in rollouts],
                                  prompt_ids=[r.prompt_ids for r in rollouts])
    with torch.no_grad():
        logits = model(**ctx.full.model_inputs()).logits
    index = ctx.full.gather_index[..., None].expand(-1, -1, logits.shape[-1])
    lp = logits.gather(1, index).log_softmax(-1).gather(-1, ctx.response_ids[..., None])[..., 0]
    sampler = batch.sampler_logprobs(ctx.response_ids.shape[1])[: len(rollouts)]
    return lp[ctx.response_mask], sampler[ctx.response_mask]
