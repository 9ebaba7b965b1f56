"""A model's weight files as vLLM loads them: which files, their SHA-256 (the teacher servers'
fingerprint) and the safetensors headers (a reload folder checked before vLLM reads it).

**Which files** (:func:`weight_files`, vLLM 0.32's default loader): a folder's ``*.safetensors``
(only those its ``model.safetensors.index.json`` names, when it has one), else its ``*.bin``
(without training state), else its ``*.pt``.

**Fingerprint** (:func:`weights_digest`): the SHA-256 of each weight file and one digest of the
sorted list (file names left out, so a copy or a re-sharding under other names of the same
bytes passes; any changed byte does not). Where a file is a link into the Hugging Face cache
whose blob is named by its SHA-256 (the hub's LFS files), that name is used, no byte read; other
files are hashed once and the result kept in ``~/.cache/saopd/sha256.json`` under the file's
path, size, inode, modification and change times. A hub id is read from the local cache when its
weight files are there, else from the hub's file list (the SHA-256 the hub records for each LFS
file; network).

**Headers** (:func:`safetensors_header`): names, dtypes and shapes, checked against the file's
size, without reading the tensors. Standard library only (and ``huggingface_hub`` for hub ids).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "FLOAT_DTYPES",
    "WeightsDigest",
    "check_reload_folder",
    "file_sha256",
    "local_model_folder",
    "safetensors_header",
    "weight_files",
    "weights_digest",
]

_SHA256 = re.compile(r"[0-9a-f]{64}")
_NOT_WEIGHTS = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt",
                "scaler.pt")
#: Safetensors dtypes a weight sync may send (the servers' dtype: never a quantized one).
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "U16": 2, "U32": 4,
                "U64": 8}
_MAX_HEADER = 100 << 20


def weight_files(folder: str | Path) -> list[Path]:
    """The files vLLM loads as the weights of the model in ``folder`` (module docstring),
    sorted; empty when it has none."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if files:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                named = set(json.loads(index.read_text())["weight_map"].values())
            except (ValueError, KeyError, TypeError, AttributeError):
                raise ValueError(f"{index} is not a safetensors index") from None
            files = [f for f in files if f.name in named]
        return files
    files = sorted(f for f in folder.glob("*.bin") if f.name not in _NOT_WEIGHTS)
    return files or sorted(f for f in folder.glob("*.pt") if f.name not in _NOT_WEIGHTS)


def _cache_path() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "saopd" / "sha256.json"


def _load_cache() -> dict[str, Any]:
    try:
        got = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def _save_cache(cache: Mapping[str, Any]) -> None:
    """Write the cache, without the entries of files that no longer exist."""
    path = _cache_path()
    cache = {name: entry for name, entry in cache.items() if os.path.exists(name)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".sha256-")
        with os.fdopen(fd, "w") as f:
            json.dump(dict(cache), f)
        os.replace(tmp, path)
    except OSError:
        pass  # a cache only


def file_sha256(path: str | Path, *, cache: dict[str, Any] | None = None) -> str:
    """The SHA-256 of the file at ``path`` (hex): the name of its Hugging Face cache blob when
    it is a link to one named by a SHA-256, else read (and kept in ``cache``, keyed by the
    file's real path, size, inode and times, when given)."""
    path = Path(path)
    real = path.resolve()
    if path.is_symlink() and _SHA256.fullmatch(real.name) and real.parent.name == "blobs":
        return real.name
    st = real.stat()
    stamp = [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]
    if cache is not None:
        hit = cache.get(str(real))
        if isinstance(hit, dict) and hit.get("stamp") == stamp:
            return str(hit["sha256"])
    digest = hashlib.sha256()
    with open(real, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    value = digest.hexdigest()
    if cache is not None:
        cache[str(real)] = {"stamp": stamp, "sha256": value}
    return value


@dataclass(frozen=True)
class WeightsDigest:
    """A model's weight files' fingerprint.

    Attributes:
        source: what was hashed (a folder, or ``hub:<id>@<revision>``).
        files: ``{file name: SHA-256}``.
        digest: SHA-256 of the sorted file digests (the fingerprint compared).
    """

    source: str
    files: dict[str, str]
    digest: str

    @classmethod
    def of(cls, source: str, files: Mapping[str, str]) -> WeightsDigest:
        joined = "\n".join(sorted(files.values()))
        return cls(source, dict(files), hashlib.sha256(joined.encode()).hexdigest())

    def as_json(self) -> dict[str, Any]:
        return {"source": self.source, "files": self.files, "digest": self.digest}


def _folder_digest(folder: Path, source: str) -> WeightsDigest:
    files = weight_files(folder)
    if not files:
        raise FileNotFoundError(f"{source} holds no weight files (*.safetensors, *.bin, *.pt)")
    cache = _load_cache()
    digests = {f.name: file_sha256(f, cache=cache) for f in files}
    _save_cache(cache)
    return WeightsDigest.of(source, digests)


def local_model_folder(location: str, revision: str | None = None) -> Path | None:
    """The folder holding the weight files of the model at ``location``: itself when it is a
    folder, the local snapshot of a hub id whose weight files are all cached, else None."""
    path = Path(location).expanduser()
    if path.is_dir():
        return path
    return _hub_folder(location, revision)


def _hub_folder(repo: str, revision: str | None) -> Path | None:
    """The local snapshot of hub model ``repo`` when its weight files are all cached."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo, revision=revision, local_files_only=True,
                                        allow_patterns=["*.json"]))
    except Exception:  # not cached (huggingface_hub raises several kinds)
        return None
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        named = set(json.loads(index.read_text()).get("weight_map", {}).values())
        return folder if named and all((folder / n).is_file() for n in named) else None
    return folder if weight_files(folder) else None


def _hub_listing(repo: str, revision: str | None) -> WeightsDigest:
    """The weight files' SHA-256 as the hub records them (its LFS metadata)."""
    from huggingface_hub import HfApi, hf_hub_download

    info = HfApi().model_info(repo, revision=revision, files_metadata=True)
    lfs = {s.rfilename: s.lfs.sha256 for s in info.siblings or []
           if s.lfs is not None and "/" not in s.rfilename}
    names = sorted(n for n in lfs if n.endswith(".safetensors"))
    if names and "model.safetensors.index.json" in {s.rfilename for s in info.siblings or []}:
        index = Path(hf_hub_download(repo, "model.safetensors.index.json", revision=revision))
        named = set(json.loads(index.read_text()).get("weight_map", {}).values())
        names = [n for n in names if n in named]
    if not names:
        names = sorted(n for n in lfs if n.endswith((".bin", ".pt")) and n not in _NOT_WEIGHTS)
    if not names:
        raise FileNotFoundError(f"hub model {repo!r} lists no weight files")
    return WeightsDigest.of(f"hub:{repo}@{info.sha}", {n: lfs[n] for n in names})


def weights_digest(location: str, revision: str | None = None) -> WeightsDigest:
    """The fingerprint of the model at ``location`` (a folder, or a hub id at ``revision``):
    module docstring. ``FileNotFoundError`` when there are no weight files; ``OSError`` when a
    hub id is neither cached nor reachable."""
    path = Path(location).expanduser()
    if path.is_dir():
        return _folder_digest(path, str(path.resolve()))
    folder = _hub_folder(location, revision)
    if folder is not None:
        return _folder_digest(folder, f"hub:{location}@{folder.name}")
    try:
        return _hub_listing(location, revision)
    except FileNotFoundError:
        raise
    except Exception as err:
        raise OSError(f"the weight files of hub model {location!r} are not in the local cache "
                      f"and the hub could not be asked for their digests ({type(err).__name__}"
                      f": {err})") from None


def safetensors_header(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{tensor name: (dtype, shape)}`` of a safetensors file, its header checked as the
    ``safetensors`` library checks it when loading: valid JSON, known dtypes, every tensor's
    byte range of its size, the ranges back to back covering the data exactly. ``ValueError``
    naming the file and the problem otherwise."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path.name}: not a safetensors file (shorter than its header)")
        length = int.from_bytes(raw, "little")
        if not 0 < length <= min(_MAX_HEADER, size - 8):
            raise ValueError(f"{path.name}: header length {length} does not fit the file "
                             f"({size} bytes)")
        try:
            header = json.loads(f.read(length))
        except ValueError:
            raise ValueError(f"{path.name}: its header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: its header is not a JSON object")
    header.pop("__metadata__", None)
    data = size - 8 - length
    out = {}
    ranges = []
    for name, entry in header.items():
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (dtype not in _DTYPE_BYTES or not isinstance(shape, list)
                or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)):
            raise ValueError(f"{path.name}: tensor {name!r} has a malformed header entry")
        start, end = offsets
        if not 0 <= start <= end <= data or end - start != math.prod(shape) * _DTYPE_BYTES[dtype]:
            raise ValueError(f"{path.name}: tensor {name!r} ({dtype} {shape}) does not fit "
                             f"bytes {start}..{end} of the {data} data bytes: a truncated or "
                             "corrupt file")
        out[str(name)] = (dtype, tuple(shape))
        ranges.append((start, end))
    ranges.sort()
    edge = 0
    for start, end in ranges:
        if start != edge:
            raise ValueError(f"{path.name}: its tensors overlap or leave a gap at byte {edge}: "
                             "a corrupt file")
        edge = end
    if edge != data:
        raise ValueError(f"{path.name}: its tensors cover {edge} of its {data} data bytes: a "
                         "truncated or corrupt file")
    return out


def check_reload_folder(folder: Path, reference: Mapping[str, tuple[int, ...]] | None,
                        tied: bool) -> int:
    """Check a folder of safetensors shards before vLLM reloads from it; returns how many
    tensors it holds. ``ValueError`` naming the problem when a file is malformed or truncated,
    a tensor is not floating point, or (with ``reference``, the served model's checkpoint
    ``{name: shape}``) a tensor is unknown or of another shape, or one of the model's tensors is
    missing (but a tied ``lm_head.weight`` or rotary buffers): vLLM reloads layer by layer, and
    a partial or mismatched set leaves layers half-replaced."""
    files = weight_files(folder)
    if not files or files[0].suffix != ".safetensors":
        raise ValueError(f"{folder} holds no *.safetensors file (that its index names)")
    got: dict[str, tuple[int, ...]] = {}
    where: dict[str, str] = {}
    for file in files:
        for name, (dtype, shape) in safetensors_header(file).items():
            if dtype not in FLOAT_DTYPES:
                raise ValueError(f"{file.name}: tensor {name!r} is {dtype}, not "
                                 f"{'/'.join(sorted(FLOAT_DTYPES))}")
            if name in got:
                raise ValueError(f"tensor {name!r} is in two shards")
            got[name], where[name] = shape, file.name
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{index.name} is not a safetensors index") from None
        stray = [f"{n} -> {f}" for n, f in weight_map.items() if where.get(n) != f]
        if stray:
            raise ValueError(f"{index.name} names {len(stray)} tensors that are not in the "
                             f"shard it says ({stray[:3]})")
    if reference is None:
        return len(got)
    unknown = sorted(set(got) - set(reference))
    wrong = [f"{n}: {got[n]} (model: {reference[n]})" for n in sorted(got)
             if n in reference and got[n] != reference[n]]
    missing = sorted(n for n in set(reference) - set(got)
                     if not (tied and n == "lm_head.weight") and "rotary_emb" not in n)
    problems = []
    if unknown:
        problems.append(f"{len(unknown)} tensors the model does not have ({unknown[:3]})")
    if wrong:
        problems.append(f"{len(wrong)} of another shape ({wrong[:3]})")
    if missing:
        problems.append(f"{len(missing)} of the model's tensors missing ({missing[:3]})")
    if problems:
        raise ValueError(f"{folder.name} does not hold the served model's weights: "
                         + "; ".join(problems))
    return len(got)
