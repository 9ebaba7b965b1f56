"""The teacher/student vocabulary check: one token -> id mapping, the same special ids, a logit for
every token; the width both heads score over (``common_logits``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["VocabularyReport", "check_same_vocabulary"]


@dataclass(frozen=True)
class VocabularyReport:
    """Result of :func:`check_same_vocabulary`.

    ``vocab_size``: tokens in the shared tokenizer; ``student_logits`` / ``teacher_logits``: output
    vocabulary sizes of the models (None when not given); ``common_logits``: the width to which
    full-vocabulary objectives must slice both models' logits (they may be padded differently,
    e.g. 151,936 vs 152,064 for Qwen2.5 sizes); ``warnings``: non-fatal differences found.
    """

    vocab_size: int
    student_logits: int | None
    teacher_logits: int | None
    common_logits: int
    warnings: tuple[str, ...]


def _output_vocab(model: nn.Module) -> int:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(model.config.get_text_config(decoder=True).vocab_size)


def _id_to_token(vocab: dict[str, int]) -> dict[int, str]:
    return {i: t for t, i in vocab.items()}


def _vocab_diff(student: dict[str, int], teacher: dict[str, int]) -> str:
    s_inv, t_inv = _id_to_token(student), _id_to_token(teacher)
    parts = [f"student has {len(student)} tokens, teacher {len(teacher)}"]
    diffs = []
    for i in sorted(set(s_inv) | set(t_inv)):
        if s_inv.get(i) != t_inv.get(i):
            diffs.append(f"id {i}: student {s_inv.get(i)!r} vs teacher {t_inv.get(i)!r}")
            if len(diffs) == 5:
                break
    if diffs:
        parts.append("first differing ids: " + "; ".join(diffs))
    only_s = sorted(set(student) - set(teacher), key=student.__getitem__)
    only_t = sorted(set(teacher) - set(student), key=teacher.__getitem__)
    if only_s:
        parts.append(f"{len(only_s)} tokens only in the student, e.g. {only_s[:5]}")
    if only_t:
        parts.append(f"{len(only_t)} tokens only in the teacher, e.g. {only_t[:5]}")
    return "; ".join(parts)


def _template_head(tokenizer: Any) -> str:
    """The start of a tokenizer's chat template (its name when it has one), for messages."""
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    text = " ".join(str(tokenizer.chat_template or "").split())
    return f"{name}: {text[:60]!r}{'...' if len(text) > 60 else ''}"


def check_same_vocabulary(
    student_tok: PreTrainedTokenizerBase,
    teacher_tok: PreTrainedTokenizerBase,
    student_model: nn.Module | None = None,
    teacher_model: nn.Module | None = None,
    *,
    strict_chat_template: bool = False,
) -> VocabularyReport:
    """Refuse a teacher/student pair that does not share one tokenizer vocabulary.

    Raises ``ValueError`` (saying what differs) when:
    - the token -> id mappings differ (sizes, first differing ids, tokens only on one side);
    - eos / bos / pad token ids differ (e.g. a Base student ending on ``<|endoftext|>`` with an
      Instruct teacher ending on ``<|im_end|>``: responses would run to the length limit);
    - a model's output vocabulary is smaller than the tokenizer (token ids without a logit).
    Warns (``UserWarning``; raises with ``strict_chat_template=True``) when the chat templates
    differ, and warns when the models' output sizes differ (padding rows): full-vocabulary
    objectives must then slice logits to ``report.common_logits``.
    """
    notes: list[str] = []
    s_vocab, t_vocab = student_tok.get_vocab(), teacher_tok.get_vocab()
    if s_vocab != t_vocab:
        raise ValueError(
            "student and teacher tokenizers do not share a vocabulary: "
            + _vocab_diff(s_vocab, t_vocab)
        )
    special = []
    for name in ("eos", "bos", "pad"):
        s_id = getattr(student_tok, f"{name}_token_id")
        t_id = getattr(teacher_tok, f"{name}_token_id")
        if s_id != t_id:
            special.append(
                f"{name}: student {getattr(student_tok, f'{name}_token')!r} (id {s_id}) vs "
                f"teacher {getattr(teacher_tok, f'{name}_token')!r} (id {t_id})"
            )
    if special:
        raise ValueError("student and teacher special tokens differ: " + "; ".join(special))
    if student_tok.chat_template != teacher_tok.chat_template:
        msg = ("student and teacher chat templates differ: rollouts and both models' contexts are "
               "rendered with the student's template (" + _template_head(student_tok) + "), so "
               "the teacher scores text in a format that is not its own (teacher's: "
               + _template_head(teacher_tok) + ")")
        if strict_chat_template:
            raise ValueError(msg)
        warnings.warn(msg, UserWarning, stacklevel=2)
        notes.append(msg)

    n = len(student_tok)
    sizes: dict[str, int | None] = {"student": None, "teacher": None}
    for role, model in (("student", student_model), ("teacher", teacher_model)):
        if model is None:
            continue
        size = _output_vocab(model)
        if size < n:
            raise ValueError(
                f"{role} model outputs {size} logits but the tokenizer has {n} tokens "
                "(ids >= the logit width could not be scored)"
            )
        sizes[role] = size
    present = [s for s in sizes.values() if s is not None]
    common = min(present) if present else n
    if len(present) == 2 and present[0] != present[1]:
        msg = (
            f"student and teacher output vocabularies differ ({sizes['student']} vs "
            f"{sizes['teacher']} logits; the tokenizer has {n}): slice logits to {common}"
        )
        warnings.warn(msg, UserWarning, stacklevel=2)
        notes.append(msg)
    return VocabularyReport(
        vocab_size=n,
        student_logits=sizes["student"],
        teacher_logits=sizes["teacher"],
        common_logits=common,
        warnings=tuple(notes),
    )
