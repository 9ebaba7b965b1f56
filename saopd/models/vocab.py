"""The teacher/student tokenizer check, graded: which kind of pair it is, what the teacher's
contexts need, and the width both heads score over (``common_logits``).

A pair is one of (``VocabularyReport.kind``):

- ``same``: one token -> id mapping, the same special tokens and the same chat template. Both
  models score the student's contexts (the common case: two sizes of one family).
- ``template_differs``: the same vocabulary and special tokens, different chat templates. The
  teacher scores its own contexts: the messages rendered with *its* template (full and residual),
  followed by the student's response ids (scoring text in a format that is not the teacher's
  biased its log-probs by +0.29 nats/token in one measurement).
- ``specials_differ``: every ordinary (non-added) token has the same id on both sides, and a
  probe corpus of ordinary text tokenizes to the same ids, but added/special tokens are renamed,
  added or missing (DeepSeek's Qwen-based distills: ids 151643-151648 hold
  ``<｜end▁of▁sentence｜>``, ``<｜User｜>``, ``<｜Assistant｜>``, ... where Qwen3 has
  ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ...). The teacher scores its own contexts,
  and the response ids are mapped into its vocabulary (:attr:`VocabularyReport.response_id_map`):
  the student's EOS / end of turn to the teacher's EOS, and any added token the teacher has
  under the same name at another id to that id; every other id is the same token on both sides.
- anything else (ordinary tokens with other ids, text that tokenizes differently, a model whose
  head is narrower than the tokenizer) is refused with a ``ValueError`` saying what differs.

The decision is taken from the tokenizer files the user has (vocabulary, added tokens, chat
template, and the tokenizers themselves on the probe corpus), not from model names. Templates are
compared as strings: two templates that render the same text for every chat still make a
``template_differs`` pair, and so do two that differ only in a block the run never reaches.

What the teacher then scores is the run's ``teacher_contexts`` choice
(:meth:`VocabularyReport.scored_contexts`): ``auto`` follows the kind as above; ``student`` makes
the teacher score exactly the student's ids (verl's on-policy distillation does this: one
rendering, one id sequence, fed to both models), refused for ``specials_differ``, where those ids
are other tokens to the teacher; ``own`` renders the teacher's contexts in its own template even
for a ``same`` pair (then the same ids as the student's).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from saopd.choices import TEACHER_CONTEXTS
from saopd.validation import check_choice

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "PAIR_KINDS",
    "PROBE_TEXTS",
    "VocabularyReport",
    "check_vocabularies",
]

PAIR_KINDS = ("same", "template_differs", "specials_differ")
"""The pairs :func:`check_vocabularies` accepts, from the closest to the farthest."""

PROBE_TEXTS: tuple[str, ...] = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.",
    "How many clips did Natalia sell altogether in April and May? Let's think step by step.",
    "The answer is \\boxed{72}. So 48 + 24 = 72, and 3.14159 * 2^10 = 3216.99 (approx.)",
    "$\\frac{a}{b} + \\sqrt{x^2 + y^2} \\leq \\int_0^1 f(t)\\,dt$",
    "def f(x):\n    return [i ** 2 for i in range(x) if i % 2 == 0]  # squares\n",
    "\t  Leading whitespace,   runs of spaces,\n\n\nand newlines.\r\n",
    "Ünïcödé: naïve café, Zoë, São Paulo, Москва, 東京, 北京大学, 한국어, العربية, हिन्दी",
    "Emoji and symbols: 🙂🚀✓ → ≤ ≥ ≠ ∑ ∞ — “quotes” ‘single’ « guillemets » ½ ¾ °C",
    "Wait, let me re-check: 17 * 23 = 391. Hmm... Alternatively, 391 / 17 = 23. Yes!",
    "URLs and ids: https://example.org/a?b=c&d=e#f user_name@mail.com 0x1F 1e-9 2026-11-24",
    "I'm sure they'll say we've done it; you'd think it's what he'd've wanted, isn't it?",
    "ALL CAPS TEXT, MiXeD cAsE, and snake_case_words with CamelCaseWords.",
)
"""Ordinary text (prose, math, LaTeX, code, whitespace, several scripts, emoji) that both
tokenizers of a pair must turn into the same ids (``add_special_tokens=False``)."""


@dataclass(frozen=True)
class VocabularyReport:
    """Result of :func:`check_vocabularies`.

    Attributes:
        vocab_size: tokens in the student's tokenizer.
        student_logits, teacher_logits: output vocabulary sizes of the models (None when not
            given).
        common_logits: the width to which full-vocabulary objectives slice both models' logits
            (they may be padded differently, e.g. 151,936 vs 152,064 for Qwen2.5 sizes).
        warnings: non-fatal differences found.
        kind: one of :data:`PAIR_KINDS` (module docstring).
        renamed_specials: ``(id, student token, teacher token)`` for every added/special id
            whose token differs (None on the side that lacks the id).
        response_id_map: student id -> teacher id for response tokens whose id means something
            else to the teacher (EOS / end of turn, same-named added tokens at other ids);
            empty unless ``kind == "specials_differ"``. Ids not in it are the same token.
        probes: how many probe texts were checked to tokenize identically.
    """

    vocab_size: int
    student_logits: int | None
    teacher_logits: int | None
    common_logits: int
    warnings: tuple[str, ...]
    kind: str = "same"
    renamed_specials: tuple[tuple[int, str | None, str | None], ...] = ()
    response_id_map: dict[int, int] = field(default_factory=dict)
    probes: int = 0

    @property
    def teacher_contexts(self) -> bool:
        """Whether ``teacher_contexts=auto`` has the teacher score its own contexts (its
        template, mapped ids): every kind but ``same``."""
        return self.kind != "same"

    def scored_contexts(self, choice: str = "auto") -> str:
        """The contexts the teacher scores under the run's ``teacher_contexts`` ``choice``:
        ``"student"`` (the student's ids) or ``"own"`` (its own template; module docstring).

        Raises ``ValueError`` for ``choice="student"`` with a ``specials_differ`` pair (the
        student's ids would be read as other tokens by the teacher), naming a renamed token.
        """
        check_choice("teacher_contexts", choice, TEACHER_CONTEXTS)
        if choice == "auto":
            return "own" if self.teacher_contexts else "student"
        if choice == "student" and self.kind == "specials_differ":
            examples = "; ".join(f"id {i} is {s!r} to the student and {t!r} to the teacher"
                                 for i, s, t in self.renamed_specials[:2])
            raise ValueError(
                "teacher_contexts=student has the teacher score exactly the student's ids, but "
                f"the two tokenizers differ (specials_differ: {len(self.renamed_specials)} "
                f"special token(s) renamed, e.g. {examples}): the teacher would read another "
                "text. Use teacher_contexts=auto or own (its own template, response ids mapped)")
        return choice

    def describe(self, choice: str = "auto") -> str:
        """One line for logs: the kind and, under ``teacher_contexts=choice``, what the teacher
        scores."""
        scored = self.scored_contexts(choice)
        if self.kind == "same":
            text = "teacher and student share one tokenizer and chat template"
        else:
            text = f"{self.kind}: " + (
                "templates differ" if self.kind == "template_differs" else
                f"{len(self.renamed_specials)} special token(s) differ, ordinary text ids equal "
                f"(checked on {self.probes} probe texts); response ids mapped "
                f"{self.response_id_map}")
        where = ("the teacher scores the student's contexts" if scored == "student" else
                 "the teacher scores contexts in its own chat template")
        return f"{text}; {where} (teacher_contexts={choice})"


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


def _added_ids(tokenizer: Any) -> set[int]:
    """Ids of a tokenizer's added tokens (special or not) and of its special tokens."""
    ids = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
    ids.update(int(i) for i in tokenizer.all_special_ids)
    return ids


def _probe_mismatch(student_tok: Any, teacher_tok: Any, texts: Sequence[str]) -> str | None:
    """The first probe text the two tokenizers encode differently, described; None if none."""
    for i, text in enumerate(texts):
        s_ids = student_tok.encode(text, add_special_tokens=False)
        t_ids = teacher_tok.encode(text, add_special_tokens=False)
        if s_ids != t_ids:
            at = next((k for k, (a, b) in enumerate(zip(s_ids, t_ids, strict=False))
                       if a != b),
                      min(len(s_ids), len(t_ids)))
            return (f"probe text {i} ({text[:50]!r}) encodes to {len(s_ids)} ids for the "
                    f"student and {len(t_ids)} for the teacher, first difference at token {at}: "
                    f"student {s_ids[at:at + 3]} vs teacher {t_ids[at:at + 3]}")
    return None


def _response_id_map(student_tok: Any, teacher_tok: Any,
                     s_vocab: dict[str, int], t_vocab: dict[str, int]) -> dict[int, int]:
    """Student id -> teacher id for the added tokens a response can hold (module docstring)."""
    mapping: dict[int, int] = {}
    for sid in sorted(_added_ids(student_tok)):
        name = student_tok.convert_ids_to_tokens(sid)
        if name in t_vocab and t_vocab[name] != sid:
            mapping[sid] = int(t_vocab[name])
    s_eos, t_eos = student_tok.eos_token_id, teacher_tok.eos_token_id
    if s_eos is not None and t_vocab.get(student_tok.eos_token) != s_eos:
        if t_eos is None:
            raise ValueError(
                f"the student ends responses with {student_tok.eos_token!r} (id {s_eos}), which "
                "the teacher's tokenizer does not have, and the teacher has no EOS token to map "
                "it to")
        mapping.setdefault(int(s_eos), int(t_eos))
    return {k: v for k, v in mapping.items() if k != v}


def check_vocabularies(
    student_tok: PreTrainedTokenizerBase,
    teacher_tok: PreTrainedTokenizerBase,
    student_model: nn.Module | None = None,
    teacher_model: nn.Module | None = None,
    *,
    probe_texts: Sequence[str] = PROBE_TEXTS,
) -> VocabularyReport:
    """Grade a teacher/student tokenizer pair (module docstring); refuse what cannot be scored.

    Raises ``ValueError`` (saying what differs) when:
    - an ordinary (non-added) token has another id, or exists on one side only (sizes, first
      differing ids, tokens only on one side);
    - a probe text tokenizes to other ids (normalisers or pre-tokenisers differ);
    - with the same special tokens on both sides, eos / bos / pad ids differ (e.g. a Base
      student ending on ``<|endoftext|>`` with an Instruct teacher ending on ``<|im_end|>``);
    - a model's output vocabulary is smaller than the tokenizer (token ids without a logit).
    Warns when the models' output sizes differ (padding rows): full-vocabulary objectives must
    then slice logits to ``report.common_logits``.
    """
    notes: list[str] = []
    s_vocab, t_vocab = student_tok.get_vocab(), teacher_tok.get_vocab()
    added = _added_ids(student_tok) | _added_ids(teacher_tok)
    s_plain = {t: i for t, i in s_vocab.items() if i not in added}
    t_plain = {t: i for t, i in t_vocab.items() if i not in added}
    if s_plain != t_plain:
        raise ValueError(
            "student and teacher tokenizers do not share a vocabulary: "
            + _vocab_diff(s_vocab, t_vocab)
        )
    mismatch = _probe_mismatch(student_tok, teacher_tok, probe_texts)
    if mismatch is not None:
        raise ValueError("student and teacher tokenizers share a vocabulary but tokenize "
                         "ordinary text differently (normaliser or pre-tokeniser): " + mismatch)
    s_inv, t_inv = _id_to_token(s_vocab), _id_to_token(t_vocab)
    renamed = tuple((i, s_inv.get(i), t_inv.get(i)) for i in sorted(added)
                    if s_inv.get(i) != t_inv.get(i))
    id_map: dict[int, int] = {}
    if renamed:
        kind = "specials_differ"
        id_map = _response_id_map(student_tok, teacher_tok, s_vocab, t_vocab)
    else:
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
        kind = "same" if student_tok.chat_template == teacher_tok.chat_template else (
            "template_differs")
    if kind != "same":
        notes.append(
            f"{kind}: under teacher_contexts=auto the teacher scores the messages rendered "
            "with its own chat template ("
            + _template_head(teacher_tok) + "); rollouts and the student's contexts use the "
            "student's (" + _template_head(student_tok) + ")")

    n = len(student_tok)
    sizes: dict[str, int | None] = {"student": None, "teacher": None}
    for role, model, tok in (("student", student_model, student_tok),
                             ("teacher", teacher_model, teacher_tok)):
        if model is None:
            continue
        size = _output_vocab(model)
        if size < len(tok):
            raise ValueError(
                f"{role} model outputs {size} logits but the tokenizer has {len(tok)} tokens "
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
        kind=kind,
        renamed_specials=renamed,
        response_id_map=id_map,
        probes=len(probe_texts),
    )
