"""Per-step token records: every response token of a training step with its signals, on disk.

The filtered-token HTML view (:mod:`saopd.analysis.token_view`) is for looking; statistics over
many tokens (the paper's Table 4, the entropy distribution of Figure 3b) need the numbers. A
*step record* keeps, for every response of one training step, only its valid tokens:

- ``response_ids``: the token ids; ``tokens``: each id decoded on its own (so the analysis needs
  no tokenizer);
- ``a_full`` (Eq. 12), ``a_res`` (Eq. 13, ``null`` without a residual pass), ``filtered``
  (True = in F, Eq. 16), and ``entropy_student`` (H_S, nats) when the step computed it;
- the prompt text (the last user message) and the step's filter statistics.

File format: JSON Lines, gzip-compressed when the name ends in ``.gz``
(``step_000042.jsonl.gz``, what :class:`saopd.lightning.callbacks.TokenViewCallback` writes to
``<run output>/token_records/`` and logs to MLflow under ``token_records/``). Line 1 is a header
``{"kind": "header", "version": 1, "step": ..., "filter": ..., "stats": {...}}``; each further line
is one response ``{"kind": "response", "index": i, "prompt": ..., "response_ids": [...],
"tokens": [...], "a_full": [...], "a_res": [...] | null, "filtered": [0, 1, ...],
"entropy_student": [...]}`` (``entropy_student`` only when present). Floats keep 6 significant
digits. Files are written atomically (temporary file, then rename).

Pure Python (json, gzip): tensors are accepted (anything with ``.tolist()``), torch is not
imported.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from saopd.analysis.token_view import TokenRow, decode_tokens, token_rows_from_batch

__all__ = [
    "RECORD_VERSION",
    "ResponseRecord",
    "StepRecord",
    "StepView",
    "find_record_dirs",
    "load_step_record",
    "load_step_records",
    "prompt_text",
    "record_path",
    "save_step_record",
    "step_record_from_view",
]

RECORD_VERSION = 1
RECORD_GLOB = "step_*.jsonl*"


@dataclass
class ResponseRecord:
    """One response of a step: its valid tokens only, all lists of one length.

    Attributes:
        prompt: the prompt text (last user message).
        response_ids: token ids.
        tokens: text of each token decoded on its own (``None`` if saved without a tokenizer).
        a_full: A_full = lpS - lpT (Eq. 12).
        a_res: A_res = lpS_res - lpT_res (Eq. 13), ``None`` without a residual pass.
        filtered: True = in F (removed from the loss).
        entropy_student: H_S per token (nats), ``None`` when not computed.
    """

    prompt: str
    response_ids: list[int]
    tokens: list[str] | None
    a_full: list[float]
    a_res: list[float] | None
    filtered: list[bool]
    entropy_student: list[float] | None = None

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        fields = {"tokens": self.tokens, "a_full": self.a_full, "a_res": self.a_res,
                  "filtered": self.filtered, "entropy_student": self.entropy_student}
        bad = {k: len(v) for k, v in fields.items() if v is not None and len(v) != n}
        if bad:
            raise ValueError(f"response record has {n} ids but field lengths {bad}")

    def to_row(self, tokenizer: Any | None = None) -> TokenRow:
        """This response as a :class:`~saopd.analysis.token_view.TokenRow`.

        Token texts come from the record; a record saved without them needs ``tokenizer``.
        """
        tokens = self.tokens
        if tokens is None:
            if tokenizer is None:
                raise ValueError("this record holds no token texts: pass the run's tokenizer")

            tokens = decode_tokens(tokenizer, self.response_ids)
        return TokenRow(prompt=self.prompt, tokens=list(tokens), a_full=list(self.a_full),
                        a_res=None if self.a_res is None else list(self.a_res),
                        filtered=list(self.filtered),
                        entropy_student=None if self.entropy_student is None
                        else list(self.entropy_student))


@dataclass
class StepRecord:
    """All recorded responses of one training step.

    Attributes:
        step: the 0-based step index (the step its metrics carry in MLflow).
        filter_name: the filter that produced ``filtered`` (e.g. ``"sa_opd"``).
        stats: the step's :func:`~saopd.filters.base.filter_stats` (over the whole batch).
        responses: one :class:`ResponseRecord` per response.
    """

    step: int
    filter_name: str | None
    stats: dict[str, float] = field(default_factory=dict)
    responses: list[ResponseRecord] = field(default_factory=list)

    def rows(self, tokenizer: Any | None = None) -> list[TokenRow]:
        """The responses as :class:`~saopd.analysis.token_view.TokenRow` s (for the view and
        :mod:`saopd.analysis.token_stats`)."""
        return [r.to_row(tokenizer) for r in self.responses]

    @property
    def has_entropy(self) -> bool:
        """True when every response carries the student entropy."""
        return bool(self.responses) and all(r.entropy_student is not None
                                            for r in self.responses)


# ---- building from a training step -------------------------------------------------------------

def prompt_text(messages: Sequence[Mapping[str, Any]] | None) -> str:
    """Text of the last message of a chat (the user turn); text parts joined for multimodal
    content (``[{"type": "text", "text": ...}, {"type": "image"}, ...]``)."""
    if not messages:
        return ""
    content = messages[-1].get("content", "")
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = []
        for part in content:
            if isinstance(part, Mapping):
                if part.get("type", "text") == "text" and "text" in part:
                    parts.append(str(part["text"]))
                else:
                    parts.append(f"<{part.get('type', 'part')}>")
            else:
                parts.append(str(part))
        return "".join(parts)
    return str(content)


@dataclass
class StepView:
    """What one training step shows of its tokens: the step's output besides its loss
    (``OPDModule.training_step`` returns ``{"loss": ..., "view": StepView}``, which Lightning
    hands to the callbacks' ``on_train_batch_end`` as ``outputs``), on the CPU.

    B rows (one per response of this rank's batch), right-padded to R tokens:

    Attributes:
        step: 0-based step index.
        messages: the prompt (a chat) of each row.
        response_ids: int [B, R] sampled token ids.
        valid: bool [B, R], True = a response token (False = padding).
        a_full: float [B, R] A_full (Eq. 12).
        a_res: float [B, R] A_res (Eq. 13); None when the step ran no residual pass.
        filtered: bool [B, R], True = in F (Eq. 16: removed from the loss).
        stats: the filter's statistics (``FilterResult.stats``: FLMR, filtered ratio, ...).
        entropy_student: float [B, R] H_S (nats), None when the step did not compute it.
    """

    step: int
    messages: list[Any]
    response_ids: Any
    valid: Any
    a_full: Any
    a_res: Any | None
    filtered: Any
    stats: dict[str, Any] = field(default_factory=dict)
    entropy_student: Any | None = None


def step_record_from_view(view: StepView, tokenizer: Any | None, *, step: int | None = None,
                          filter_name: str | None = None,
                          max_rows: int | None = None) -> StepRecord:
    """A step record from the training step's :class:`StepView`.

    Args:
        view: the step's tokens and signals.
        tokenizer: decodes each id into ``tokens``; ``None`` stores ids only.
        step: 0-based step index; None (default): the view's own (:attr:`StepView.step`).
        filter_name: the filter's name.
        max_rows: keep only the first responses; ``None`` (default): the whole batch.
    """
    step = view.step if step is None else step
    prompts = [prompt_text(m) for m in view.messages]
    if tokenizer is None:
        tokenizer = _IdsAsText()
        keep_text = False
    else:
        keep_text = True
    rows = token_rows_from_batch(tokenizer, prompts, view.response_ids, view.valid,
                                 view.a_full, view.a_res, view.filtered,
                                 max_rows=max_rows, entropy_student=view.entropy_student)
    ids = _valid_ids(view.response_ids, view.valid, len(rows))
    responses = [
        ResponseRecord(prompt=r.prompt, response_ids=i, tokens=r.tokens if keep_text else None,
                       a_full=r.a_full, a_res=r.a_res, filtered=r.filtered,
                       entropy_student=r.entropy_student)
        for r, i in zip(rows, ids, strict=True)
    ]
    stats = {str(k): float(v) for k, v in dict(view.stats or {}).items()}
    return StepRecord(step=int(step), filter_name=filter_name, stats=stats, responses=responses)


class _IdsAsText:
    """Stand-in tokenizer for :func:`token_rows_from_batch` when no tokenizer is given."""

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [str(i) for i in ids]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens)


def _valid_ids(response_ids: Any, valid: Any, n_rows: int) -> list[list[int]]:
    """The first ``n_rows`` rows of ``response_ids`` at their valid positions, as python ints."""
    def plain(x: Any) -> Any:
        if hasattr(x, "detach"):
            x = x.detach().cpu()
        return x.tolist() if hasattr(x, "tolist") else x

    ids, mask = plain(response_ids), plain(valid)
    return [[int(i) for i, v in zip(ids[b], mask[b], strict=True) if v] for b in range(n_rows)]


# ---- files ---------------------------------------------------------------------------------

def record_path(folder: str | Path, step: int, *, compress: bool = True) -> Path:
    """``<folder>/step_XXXXXX.jsonl[.gz]`` for a 0-based step index."""
    return Path(folder) / f"step_{int(step):06d}.jsonl{'.gz' if compress else ''}"


def _round(values: Iterable[float]) -> list[float]:
    return [float(f"{float(v):.6g}") for v in values]


def _lines(record: StepRecord) -> Iterable[str]:
    header = {"kind": "header", "version": RECORD_VERSION, "step": record.step,
              "filter": record.filter_name, "stats": record.stats}
    yield json.dumps(header)
    for i, r in enumerate(record.responses):
        row: dict[str, Any] = {
            "kind": "response", "index": i, "prompt": r.prompt,
            "response_ids": [int(x) for x in r.response_ids],
            "tokens": r.tokens,
            "a_full": _round(r.a_full),
            "a_res": None if r.a_res is None else _round(r.a_res),
            "filtered": [int(bool(x)) for x in r.filtered],
        }
        if r.entropy_student is not None:
            row["entropy_student"] = _round(r.entropy_student)
        yield json.dumps(row, ensure_ascii=False)


def _open_text(path: Path, mode: str, gz: bool) -> IO[str]:
    if gz:
        return gzip.open(path, mode + "t", encoding="utf-8")  # type: ignore[return-value]
    return open(path, mode, encoding="utf-8")


def save_step_record(record: StepRecord, path: str | Path) -> Path:
    """Write ``record`` to ``path`` (gzip when it ends in ``.gz``) atomically; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        with _open_text(Path(tmp), "w", gz=path.name.endswith(".gz")) as fh:
            for line in _lines(record):
                fh.write(line + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_step_record(path: str | Path) -> StepRecord:
    """Read a file written by :func:`save_step_record` (``ValueError`` names the bad line)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no token record at {path}")
    header: dict[str, Any] | None = None
    responses: list[ResponseRecord] = []
    with _open_text(path, "r", gz=path.name.endswith(".gz")) as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: line {n} is not JSON ({err.msg})") from None
            kind = obj.get("kind") if isinstance(obj, dict) else None
            if n == 1:
                if kind != "header":
                    raise ValueError(f"{path}: line 1 is not a token-record header")
                if obj.get("version") != RECORD_VERSION:
                    raise ValueError(f"{path}: token-record version {obj.get('version')!r}, "
                                     f"this code reads version {RECORD_VERSION}")
                header = obj
                continue
            if kind != "response":
                raise ValueError(f"{path}: line {n} is not a response record")
            try:
                responses.append(ResponseRecord(
                    prompt=str(obj.get("prompt", "")),
                    response_ids=[int(x) for x in obj["response_ids"]],
                    tokens=obj.get("tokens"),
                    a_full=[float(x) for x in obj["a_full"]],
                    a_res=None if obj.get("a_res") is None else [float(x) for x in obj["a_res"]],
                    filtered=[bool(x) for x in obj["filtered"]],
                    entropy_student=None if obj.get("entropy_student") is None
                    else [float(x) for x in obj["entropy_student"]],
                ))
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"{path}: line {n}: bad response record ({err})") from None
    if header is None:
        raise ValueError(f"{path}: empty token record")
    return StepRecord(step=int(header["step"]), filter_name=header.get("filter"),
                      stats={str(k): float(v) for k, v in (header.get("stats") or {}).items()},
                      responses=responses)


def find_record_dirs(root: str | Path) -> list[Path]:
    """Every ``token_records/`` folder holding a record under ``root`` (e.g. ``outputs/``),
    most recently modified last."""
    root = Path(root)
    found = {p.parent for p in root.glob(f"**/token_records/{RECORD_GLOB}")}
    return sorted(found, key=lambda d: max(f.stat().st_mtime for f in d.glob(RECORD_GLOB)))


def load_step_records(folder: str | Path, steps: Iterable[int] | None = None) -> list[StepRecord]:
    """Every ``step_*.jsonl[.gz]`` record in ``folder`` (or a run output folder holding
    ``token_records/``), sorted by step; ``steps`` keeps only those step indices.

    Raises ``FileNotFoundError`` naming the folder when it holds no record.
    """
    folder = Path(folder)
    if (folder / "token_records").is_dir():
        folder = folder / "token_records"
    paths = sorted(folder.glob(RECORD_GLOB)) if folder.is_dir() else []
    if not paths:
        raise FileNotFoundError(
            f"no token records ({RECORD_GLOB}) in {folder}; training writes them every "
            "trainer.view_every_n_steps steps to <output>/token_records/")
    records = [load_step_record(p) for p in paths]
    if steps is not None:
        wanted = {int(s) for s in steps}
        records = [r for r in records if r.step in wanted]
    return sorted(records, key=lambda r: r.step)
