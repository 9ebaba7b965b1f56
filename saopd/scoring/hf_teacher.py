"""``teacher_scoring=hf`` as a service: the teacher's module scores in this process.

:class:`HFTeacherScorer` meets the :class:`~saopd.scoring.teacher_service.TeacherScorer`
contract with chunked scoring (:func:`~saopd.scoring.passes.score_teacher`), exact and
synchronous. The trainer's default path (``OPDModule`` with a teacher module) runs the same
passes directly; this class is the reference the other backends are compared against.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from saopd.contexts.batch import PairedContextBatch
from saopd.scoring.passes import PendingTeacherScores, ScoringNeeds, score_teacher
from saopd.scoring.teacher_service import DoneTeacherScores

if TYPE_CHECKING:
    from torch import nn

__all__ = ["HFTeacherScorer"]


class HFTeacherScorer:
    """``teacher_scoring=hf`` as a service: the teacher's module scores in this process,
    synchronously (:func:`~saopd.scoring.passes.score_teacher`)."""

    name = "hf"

    def __init__(self, teacher: nn.Module, *, vocab_size: int | None = None,
                 chunk_size: int | None = None) -> None:
        self.teacher = teacher
        self.vocab_size = vocab_size
        self.chunk_size = chunk_size

    def submit(self, batch: PairedContextBatch, needs: ScoringNeeds, *,
               messages: Sequence[Sequence[Mapping[str, Any]]] | None = None
               ) -> PendingTeacherScores:
        scores, _ = score_teacher(batch, self.teacher, needs=needs, vocab_size=self.vocab_size,
                                  chunk_size=self.chunk_size)
        return DoneTeacherScores(scores)

    def close(self) -> None:
        pass
