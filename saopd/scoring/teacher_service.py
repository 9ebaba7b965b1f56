"""Teacher scoring as a service: the contract every backend meets, and what a service can serve.

One small interface, :class:`TeacherScorer`: ``submit(batch, needs, messages=...)`` sends the
step's teacher contexts (``batch.teacher_view``: the student's contexts, or the teacher's own when
it has its own chat template) and returns at once a :class:`~saopd.scoring.passes.
PendingTeacherScores`; its ``result()`` gives :class:`~saopd.scoring.passes.TeacherScores`
``[B, R]`` (full, and residual when the step needs it) in the layout of the batch.
:func:`~saopd.scoring.passes.score_frozen` takes the pending scores and
:func:`~saopd.scoring.passes.score_student` waits for them only after the student's pass, so the
teacher scores while the student's residual and full passes run. Backends
(``teacher_scoring=<backend>``, :class:`~saopd.config.teacher_scoring.TeacherScoringConfig`;
built from a run's config by :func:`saopd.scoring.registry.build_scorer`), one module each:

- ``hf`` (:class:`~saopd.scoring.hf_teacher.HFTeacherScorer`): the teacher's module in this
  process, chunked scoring (:func:`~saopd.scoring.passes.score_teacher`); exact, synchronous.
  The trainer's default path (``OPDModule`` with a teacher module) runs the same passes
  directly, with the teacher's head for the exact KL and top-k lists.
- ``vllm`` (:class:`~saopd.vllm.teacher.VLLMTeacherScorer`): a ``vllm.LLM`` of the teacher (its
  engine core in its own process by default, so the teacher computes while the trainer
  computes; on GPU on its own devices, ``teacher_scoring.devices``).
- ``vllm_server`` (:class:`~saopd.vllm.client.teacher.VLLMServerTeacherScorer`):
  ``saopd-serve`` servers of the teacher over HTTP (``/v1/completions``); the trainer imports no
  ``vllm``. At start-up every server must prove it serves the teacher
  (:mod:`saopd.vllm.client.teacher_server`); a server of another model or checkpoint is refused,
  naming both.

How the vLLM backends send contexts and read the log-probs back is
:mod:`saopd.vllm.prompt_logprobs`. Only sampled-token log-probs come back.
:func:`check_servable` refuses at start-up, naming the option and what it needs, whatever asks
for more: the exact KL over the vocabulary (``objective=full_kl``, ``filter=tip``), the
teacher's entropy (``filter=fire``, ``objective=entropy_aware``), the teacher's top-k lists
(``objective=topk_kl``, ``entropy_aware``, ``filter=teachability``) and the teacher's log-probs
at the student's top-k ids (``filter=teachability``), unless ``teacher_scoring.top_k = K`` asks
for the top-k approximation: the teacher's top-K log-probs per position come back
(``prompt_logprobs=K``) and serve the teacher-top-k fields of any K' <= K (the teacher's own top
K'; the student's log-probs at those ids come from its pass, ``gather_ids``) and the teacher's
entropy, over the top K and one bucket holding the rest of the probability (a lower bound of the
entropy). The exact KL and the student's top-k lists are never served.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

from saopd.contexts.batch import PairedContextBatch
from saopd.scoring.passes import PendingTeacherScores, ScoringNeeds, TeacherScores
from saopd.signals.token_signals import STUDENT_TOPK_FIELDS, TEACHER_TOPK_FIELDS

__all__ = [
    "DoneTeacherScores",
    "FutureTeacherScores",
    "TeacherScorer",
    "check_servable",
    "unservable",
]


@runtime_checkable
class TeacherScorer(Protocol):
    """A teacher-scoring backend (module docstring)."""

    name: str

    def submit(self, batch: PairedContextBatch, needs: ScoringNeeds, *,
               messages: Sequence[Sequence[Mapping[str, Any]]] | None = None
               ) -> PendingTeacherScores:
        """Start scoring ``batch.teacher_view`` (full, and residual if ``needs.residual``);
        ``messages``: the rows' chats (their images, for a vision-language pair)."""
        ...

    def close(self) -> None:
        """Free what the backend holds (engines, threads, folders)."""
        ...


class DoneTeacherScores:
    """Scores already computed (a synchronous backend)."""

    def __init__(self, scores: TeacherScores) -> None:
        self._scores = scores

    def result(self) -> TeacherScores:
        return self._scores


class FutureTeacherScores:
    """Scores computed in a worker thread (the vLLM backends')."""

    def __init__(self, future: Future[TeacherScores]) -> None:
        self._future = future

    def result(self) -> TeacherScores:
        return self._future.result()


# ---------------------------------------------------------------------------------------------
# what a service can serve

#: What each signal a service cannot give exactly needs, for the refusal messages.
_NEEDS_TEXT = {
    "kl": "the exact KL over the teacher's whole distribution (its full logits at every "
          "position)",
    "entropy_teacher": "the teacher's entropy over its whole distribution",
    "teacher_topk": "the teacher's top-{k} log-probs at every position",
    "student_topk": "the teacher's log-probs at the student's top-{k} tokens",
}


def unservable(components: Mapping[str, Any], top_k: int) -> list[str]:
    """What of ``components`` (``{"objective=full_kl": objective, "filter=tip": filter, ...}``,
    each with ``needs`` and ``top_k``) a vLLM teacher service with ``teacher_scoring.top_k =
    top_k`` cannot give: one message per component naming it and what it needs."""
    out = []
    for label, component in components.items():
        names = set(getattr(component, "needs", ()))
        k = int(getattr(component, "top_k", 0) or 0)
        missing = []
        if "kl" in names:
            missing.append(_NEEDS_TEXT["kl"])
        if "entropy_teacher" in names and top_k < 1:
            missing.append(_NEEDS_TEXT["entropy_teacher"] + " (teacher_scoring.top_k=K "
                           "approximates it over the top K + one tail bucket)")
        if set(TEACHER_TOPK_FIELDS) & names and top_k < k:
            missing.append(_NEEDS_TEXT["teacher_topk"].format(k=k)
                           + f" (teacher_scoring.top_k={k} or more gives them)")
        if set(STUDENT_TOPK_FIELDS) & names:
            missing.append(_NEEDS_TEXT["student_topk"].format(k=k))
        if missing:
            out.append(f"{label} needs " + " and ".join(missing))
    return out


def check_servable(components: Mapping[str, Any], backend: str, top_k: int) -> None:
    """``ValueError`` naming each option that needs more than ``teacher_scoring=<backend>``
    gives (:func:`unservable`); nothing for ``hf``."""
    if backend == "hf":
        return
    problems = unservable(components, top_k)
    if problems:
        raise ValueError(
            f"teacher_scoring={backend} returns the teacher's sampled-token log-probs"
            + (f" and its top-{top_k} log-probs" if top_k else "") + " only: "
            + "; ".join(problems) + ". Use teacher_scoring=hf for these (exact, teacher in the "
            "trainer)")
