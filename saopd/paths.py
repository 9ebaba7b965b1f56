"""Where the repository is: the root that default paths (``conf/``, ``data/``, ``outputs/``,
``mlflow.db``, ``mlartifacts/``) resolve against, whatever the working directory.

The root is the folder holding the ``saopd`` package's source tree (a checkout with an editable
install, as ``make setup`` makes), recognised by its ``conf/`` folder and ``pyproject.toml``;
``$SAOPD_ROOT`` overrides it (a copy of the configs elsewhere, an installed package). The Hydra
configs read it through the ``${saopd_root:}`` resolver, and every path built on it stays a
config value (``paths.root=...``, ``data.path=...``, ``logger.tracking_uri=...``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["ROOT_ENV", "conf_dir", "config_dirs", "default_tracking_uri", "register_resolvers",
           "repo_root", "yaml_problem"]

#: Environment variable that overrides the repository root.
ROOT_ENV = "SAOPD_ROOT"
_MARKERS = ("conf", "pyproject.toml")


def repo_root() -> Path:
    """The repository root (absolute): ``$SAOPD_ROOT`` if set, else the parent of the package.

    Raises ``FileNotFoundError`` naming the folder when it lacks ``conf/`` or
    ``pyproject.toml`` (the package was installed without its repository: set ``SAOPD_ROOT``).
    """
    env = os.environ.get(ROOT_ENV)
    root = Path(env).expanduser().resolve() if env else Path(__file__).resolve().parent.parent
    missing = [m for m in _MARKERS if not (root / m).exists()]
    if missing:
        where = f"${ROOT_ENV}={env}" if env else f"the package's parent folder {root}"
        raise FileNotFoundError(
            f"{where} is not a saopd repository (no {' or '.join(missing)}); set {ROOT_ENV} to "
            "the folder that holds conf/ and pyproject.toml")
    return root


def default_tracking_uri(root: str | os.PathLike[str] | None = None) -> str:
    """``sqlite:///<absolute root>/mlflow.db``: the local MLflow store saopd-train, saopd-eval and
    saopd-report use unless told otherwise (``root`` None: the repository root). Nothing is
    created."""
    base = repo_root() if root is None else Path(root).expanduser().resolve()
    return f"sqlite:///{(base / 'mlflow.db').as_posix()}"


def conf_dir() -> Path:
    """The Hydra config folder, ``<root>/conf``."""
    return repo_root() / "conf"


def register_resolvers() -> None:
    """Register ``${saopd_root:}`` with OmegaConf (idempotent); the entry points call it."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("saopd_root"):
        OmegaConf.register_new_resolver("saopd_root", lambda: str(repo_root()))


def searchpath_dirs(value: str) -> list[Path]:
    """The local folders of a ``hydra.searchpath`` value as written on a command line
    (``[file:///a,/b]``, one entry or a list); ``pkg://`` entries (inside installed packages)
    are not local folders and are left out."""
    text = value.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    dirs = []
    for entry in (e.strip().strip("'\"") for e in text.split(",")):
        if not entry or entry.startswith("pkg://"):
            continue
        dirs.append(Path(entry.removeprefix("file://")).expanduser())
    return dirs


def config_dirs(argv: Sequence[str]) -> list[Path]:
    """The folders of YAML configs an entry point's command line ``argv`` reads: ``conf/``
    (:func:`conf_dir`), those ``--config-dir`` / ``-cd`` add, and the local folders of a
    ``hydra.searchpath=`` override (:func:`searchpath_dirs`)."""
    dirs = [conf_dir()]
    for i, arg in enumerate(argv):
        if arg in ("--config-dir", "-cd") and i + 1 < len(argv):
            dirs.append(Path(argv[i + 1]).expanduser())
        elif arg.startswith("--config-dir="):
            dirs.append(Path(arg.split("=", 1)[1]).expanduser())
        elif arg.lstrip("+~").startswith("hydra.searchpath="):
            dirs.extend(searchpath_dirs(arg.split("=", 1)[1]))
    return dirs


def yaml_problem(folders: Iterable[Path]) -> str | None:
    """The first YAML syntax error in the ``*.yaml`` files under ``folders``, as one line
    (``<file>, line L, column C: <problem> (<context> at line L')``); None when every file
    parses. Hydra reports such an error in a traceback of some 40 lines before the file and
    line."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    for folder in folders:
        for path in sorted(Path(folder).rglob("*.yaml")) if Path(folder).is_dir() else []:
            try:
                yaml.load(path.read_text(encoding="utf-8"), Loader=loader)  # a safe loader
            except yaml.MarkedYAMLError as err:
                mark = err.problem_mark or err.context_mark
                where = (f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark
                         else str(path))
                context = err.context_mark
                why = err.problem or err.context or "not valid YAML"
                if err.problem and err.context and context is not None:
                    why += f" ({err.context} at line {context.line + 1})"
                return f"{where}: {why}"
            except (yaml.YAMLError, UnicodeDecodeError) as err:
                return f"{path}: {err}"
    return None
