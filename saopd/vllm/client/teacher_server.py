"""One teacher server (``teacher_scoring=vllm_server``): the client of a ``saopd-serve`` server
of the teacher (:class:`TeacherServerClient`: its model card, its tokenizer, one scoring
request), and the proof that it serves the teacher (:class:`TeacherReference`, its config and
the SHA-256 of its weight files; :meth:`TeacherServerClient.check_serves`).
:class:`~saopd.vllm.client.teacher.VLLMServerTeacherScorer` deals each step's contexts out over
these clients; every failure raises :class:`TeacherServiceError` (the in-process scorer's too).

A server started on the wrong folder (the student's, another checkpoint) would otherwise be
scored from without a word. Its model's config (``saopd_server_info``:
:func:`~saopd.vllm.identity.config_values`) must equal the teacher's ``config.json``, and the
digest of the weight files it loaded (``saopd_server_weights_digest``, computed on the server
where its files are) the digest of the teacher's weight files, computed where the trainer finds
them (:func:`~saopd.vllm.weights_files.weights_digest`: the teacher's folder, the local hub
cache, else the hub's file list). Why a digest of the files: docs/teacher_scoring.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from saopd.vllm.client.http import JsonClient, ServerError
from saopd.vllm.identity import config_differences, config_values
from saopd.vllm.weights_files import WeightsDigest, weights_digest

if TYPE_CHECKING:
    from saopd.config.model import ModelConfig

__all__ = ["TeacherReference", "TeacherServerClient", "TeacherServiceError", "teacher_reference"]


class TeacherServiceError(ServerError):
    """A teacher server (or engine) failed, cannot be reached, answered something unusable or
    does not serve the teacher; the message names it. An ``OSError``, so ``saopd-train`` reports
    it as a one-line error."""


@dataclass(frozen=True)
class TeacherReference:
    """What a teacher server must serve (:func:`teacher_reference`).

    Attributes:
        name: the teacher as configured (``teacher.name_or_path``), for messages.
        config: its :func:`~saopd.vllm.identity.config_values`.
        weights: the fingerprint of its weight files.
    """

    name: str
    config: dict[str, Any]
    weights: WeightsDigest


def teacher_reference(teacher: ModelConfig) -> TeacherReference:
    """The :class:`TeacherReference` of the teacher ``teacher`` configures: its config and the
    digest of its weight files, read where they are (a folder, the local hub cache, else the
    hub's file list). ``ValueError`` for a teacher that exists only once built (tiny, pruned,
    GGUF: its served copy cannot be checked against its config), ``OSError`` when its files
    cannot be read."""
    from transformers import AutoConfig

    from saopd.models.loading import resolve_source

    name = teacher.name_or_path
    if name is None or not teacher.loads_as_is:
        raise ValueError(
            "teacher_scoring=vllm_server checks that every server serves the teacher's weight "
            "files, which needs a teacher given as an HF folder or hub id (teacher.name_or_path; "
            "no tiny, pruned or GGUF teacher, which exists only once built): save it "
            "(save_pretrained, with its tokenizer), serve that folder and name it in "
            "teacher.name_or_path")
    source = resolve_source(name, None, kind="model")
    config = AutoConfig.from_pretrained(source.location, revision=teacher.revision,
                                        trust_remote_code=teacher.trust_remote_code)
    return TeacherReference(str(name), config_values(config),
                            weights_digest(source.location, teacher.revision))


class TeacherServerClient(JsonClient):
    """JSON over HTTP with one teacher server (every failure an ``error``, naming its URL), and
    the calls the teacher scorer makes.

    Args:
        url: the server's base URL.
        timeout: seconds a request may take (``teacher_scoring.request_timeout``).
        error: the exception class raised (``TeacherServiceError``).
        api_key: the server's API key (None: sent without one).
    """

    #: A text each server must tokenize as the teacher's tokenizer does.
    PROBE_TEXT = "The teacher scores 12 * 7 = 84 tokens, step by step."

    def __init__(self, url: str, timeout: float, *, error: type[ServerError],
                 api_key: str | None = None) -> None:
        super().__init__(url, timeout, role="teacher server", error=error,
                         request_option="teacher_scoring.request_timeout",
                         startup_option="teacher_scoring.startup_timeout", api_key=api_key,
                         key_option="teacher_scoring.api_key_file")

    def model_card(self, model: str | None) -> tuple[str, int]:
        """``(model id, max_model_len)`` of ``GET /v1/models``: the card of ``model``, or of the
        first model listed when None."""
        got = self.call("GET", "/v1/models")
        cards = got.get("data") if isinstance(got, dict) else None
        if not isinstance(cards, list) or not cards or not all(
                isinstance(c, dict) and isinstance(c.get("id"), str) for c in cards):
            raise self.error(f"teacher server {self.url}: /v1/models answered "
                             f"{str(got)[:200]}, not a list of models")
        if model is None:
            model = str(cards[0]["id"])
        card = next((c for c in cards if c["id"] == model), None)
        if card is None:
            raise self.error(
                f"teacher server {self.url} serves {[c['id'] for c in cards]}, not "
                f"{model!r} (teacher_scoring.model, or the first server's model)")
        return model, int(card.get("max_model_len") or 1 << 30)

    def check_tokenizer(self, model: str, tokenizer: Any) -> None:
        """The server tokenizes :data:`PROBE_TEXT` as ``tokenizer`` (the teacher's) does."""
        want = [int(t) for t in tokenizer(self.PROBE_TEXT, add_special_tokens=False)[
            "input_ids"]]
        got = self.call("POST", "/tokenize", {"model": model, "prompt": self.PROBE_TEXT,
                                              "add_special_tokens": False})
        tokens = got.get("tokens") if isinstance(got, dict) else None
        if tokens != want:
            raise self.error(
                f"teacher server {self.url} tokenizes a probe text as {tokens}, the "
                f"teacher's tokenizer as {want}: it does not serve the teacher")

    def check_serves(self, teacher: TeacherReference) -> None:
        """An ``error`` naming both unless the server serves ``teacher``: its model's config
        and its weight files' digest."""
        info = self.rpc("saopd_server_info")
        served, config = info.get("model"), info.get("config")
        if not isinstance(config, dict):
            raise self.garbage("/collective_rpc saopd_server_info", "the served model's config",
                                 info)
        if info.get("broken"):
            raise self.error(f"teacher server {self.url}: a weight reload failed there "
                                      f"({info['broken']}); restart it (saopd-serve)")
        differ = config_differences(config, teacher.config, "teacher")
        if differ:
            raise self.error(
                f"teacher server {self.url} serves {served!r}, a model that differs from the "
                f"teacher {teacher.name!r}: {', '.join(differ)}; serve the teacher (saopd-serve "
                "--model <teacher.name_or_path>)")
        got = self.rpc("saopd_server_weights_digest")
        if not isinstance(got.get("digest"), str):
            raise self.error(f"teacher server {self.url} cannot fingerprint the weights "
                                      f"it serves: {got.get('error') or got}")
        if got["digest"] != teacher.weights.digest:
            raise self.error(
                f"teacher server {self.url} serves the weights of {got.get('source')!r} (SHA-256 "
                f"digest {got['digest'][:16]}), not those of the teacher {teacher.name!r} "
                f"({teacher.weights.source}, {teacher.weights.digest[:16]}): another checkpoint of "
                "the same architecture; serve the teacher's folder")

    def prompt_logprobs(self, model: str, prompts: list[list[int]], k: int
                        ) -> list[tuple[list[int], list[Any]]]:
        """``(prompt ids, prompt_logprobs)`` of each token-id prompt, in order (one
        ``/v1/completions`` request: ``max_tokens: 1``, ``prompt_logprobs: k``), checked: one
        choice per prompt, the prompt ids it scored are those sent, one entry per token."""
        body = {"model": model, "prompt": prompts, "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": k, "return_token_ids": True, "skip_special_tokens": False}
        got = self.call("POST", "/v1/completions", body)
        choices = got.get("choices") if isinstance(got, dict) else None
        if not isinstance(choices, list) or len(choices) != len(prompts):
            raise self.error(f"teacher server {self.url}: /v1/completions answered "
                             f"{str(got)[:200]}, not {len(prompts)} choices")
        out: list[tuple[list[int], list[Any]]] = [([], [])] * len(prompts)
        for choice in choices:
            i = choice.get("index") if isinstance(choice, dict) else None
            plp = choice.get("prompt_logprobs") if isinstance(choice, dict) else None
            ids = choice.get("prompt_token_ids") if isinstance(choice, dict) else None
            if not isinstance(i, int) or not 0 <= i < len(prompts) or not isinstance(plp, list):
                raise self.error(f"teacher server {self.url}: a choice without "
                                 f"prompt log-probs ({str(choice)[:200]})")
            if ids is not None and list(ids) != prompts[i]:
                raise self.error(f"teacher server {self.url} scored other prompt ids "
                                 f"than it was sent ({len(ids)} vs {len(prompts[i])})")
            if len(plp) != len(prompts[i]):
                raise self.error(f"teacher server {self.url} returned {len(plp)} "
                                 f"prompt log-probs for {len(prompts[i])} tokens")
            out[i] = (prompts[i], plp)
        return out
