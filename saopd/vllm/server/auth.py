"""The shared secret between ``saopd-serve`` servers and their clients (the trainer).

Every endpoint of a ``saopd-serve`` server answers 401 unless the request carries
``Authorization: Bearer <key>`` (:mod:`saopd.vllm.server.guard`). The key:

- on the server (:func:`server_api_key`): ``SAOPD_SERVE_API_KEY`` when set; else the content of
  ``--api-key-file`` when that file exists; else a new random key (256 bits), written to
  ``--api-key-file`` or, by default, to :func:`default_key_file` (``~/.cache/saopd/serve-keys/
  <host>-<port>.key``), readable by its owner only. The key itself is never printed or put on a
  command line (``ps`` shows command lines to every user): saopd-serve prints the file's path.
- in the trainer (:func:`client_api_key`): the file named by ``rollout.api_key_file`` /
  ``teacher_scoring.api_key_file`` (a path, so the config, its dump and MLflow's params hold no
  secret); else ``SAOPD_SERVE_API_KEY``; else, for a server on this machine (a loopback URL),
  the default key file of its port. A key file must not be readable by group or others.

Standard library only.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import stat
import urllib.parse
from pathlib import Path

__all__ = [
    "API_KEY_ENV",
    "client_api_key",
    "default_key_file",
    "is_loopback",
    "read_key_file",
    "server_api_key",
    "write_key_file",
]

#: The environment variable holding the key (server and trainer).
API_KEY_ENV = "SAOPD_SERVE_API_KEY"


def default_key_file(port: int, host: str | None = None) -> Path:
    """Where saopd-serve writes a key it generated: ``$XDG_CACHE_HOME`` (or ``~/.cache``)
    ``/saopd/serve-keys/<host>-<port>.key``, ``host`` = this machine's name by default."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "saopd" / "serve-keys" / f"{host or socket.gethostname()}-{port}.key"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine only."""
    if host.strip("[]") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def write_key_file(path: str | Path, key: str) -> Path:
    """Write ``key`` to ``path`` readable by its owner only (mode 0600, replaced atomically)."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (key + "\n").encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def read_key_file(path: str | Path, what: str) -> str:
    """The key in file ``path``; ``ValueError`` naming ``what`` (the option or flag that named
    it) when it is missing, empty, or readable by group or others."""
    path = Path(path).expanduser()
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as err:
        raise ValueError(f"{what}: cannot read the API key file {str(path)!r} "
                         f"({type(err).__name__}: {err.strerror or err})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{what}: the API key file {str(path)!r} is readable by other users "
                         f"(mode {stat.S_IMODE(mode):o}): chmod 600 it")
    if not text or any(c.isspace() for c in text):
        raise ValueError(f"{what}: the API key file {str(path)!r} must hold one key "
                         "(no spaces)")
    return text


def server_api_key(key_file: str | None, port: int) -> tuple[str, str]:
    """``(key, where)`` for a server on ``port``: ``SAOPD_SERVE_API_KEY``, else the file
    ``key_file`` if it exists, else a new key written to ``key_file`` (None =
    :func:`default_key_file`). ``where`` says where the key is, for the start-up message
    (never the key). ``ValueError`` for an unusable key file."""
    env = os.environ.get(API_KEY_ENV, "")
    if env:
        if any(c.isspace() for c in env):
            raise ValueError(f"{API_KEY_ENV} must be one key without spaces")
        return env, f"the environment variable {API_KEY_ENV}"
    path = Path(key_file).expanduser() if key_file else default_key_file(port)
    if key_file and path.exists():
        return read_key_file(path, "--api-key-file"), f"the file {path}"
    key = secrets.token_urlsafe(32)
    write_key_file(path, key)
    return key, f"the file {path} (new)"


def client_api_key(key_file: str | None, url: str, option: str) -> str | None:
    """The key a client of the server at ``url`` sends: the file ``key_file`` (the config option
    ``option``), else ``SAOPD_SERVE_API_KEY``, else for a loopback URL the server's default key
    file (:func:`default_key_file`) if it exists; None when there is none (the server will
    answer 401, which the client reports with how to pass the key)."""
    if key_file:
        return read_key_file(key_file, option)
    env = os.environ.get(API_KEY_ENV, "")
    if env:
        return env
    parts = urllib.parse.urlsplit(url)
    if parts.hostname and is_loopback(parts.hostname):
        port = parts.port or (443 if parts.scheme == "https" else 80)
        path = default_key_file(port)
        if path.exists():
            return read_key_file(path, f"the key file of the server at {url}")
    return None
