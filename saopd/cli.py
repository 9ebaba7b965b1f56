"""The command lines ``saopd-train`` and ``saopd-eval``: Hydra's apps, light to import.

Each checks that every YAML file it may read parses, then lets Hydra compose the config, print
``--help`` or refuse a misconfigured launcher or sweeper, all before torch, Lightning,
transformers or MLflow are imported; the job itself (:func:`saopd.train.run_job`,
:func:`saopd.evaluate.run_job`) imports them when it starts. So ``saopd-train --help`` and a
mistyped override answer in about a second or two, not after the ~13 s that those imports take
on a 2-core CPU (docs/benchmarks.md). A sweep's task function is :func:`train_app`'s job:
launchers that start a process per job import this module and the job's own modules there.
"""

from __future__ import annotations

import sys
from typing import Any

import hydra
from omegaconf import DictConfig

from saopd.config import register_schema
from saopd.paths import conf_dir, config_dirs, register_resolvers, yaml_problem

CONF_DIR = str(conf_dir())

register_schema()
register_resolvers()


def _exit_on_yaml_problem(command: str) -> None:
    """Exit with status 2 and one line naming the file, line and column when a YAML file the
    command line may read (``conf/``, ``--config-dir``, ``hydra.searchpath``) does not parse."""
    problem = yaml_problem(config_dirs(sys.argv[1:]))
    if problem is not None:
        print(f"{command}: error: {problem}", file=sys.stderr)
        sys.exit(2)


def train_main() -> None:
    """``saopd-train``: :func:`train_app` on the command line's config."""
    _exit_on_yaml_problem("saopd-train")
    train_app()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def train_app(cfg: DictConfig) -> dict[str, Any] | None:
    """The Hydra app of ``saopd-train`` (a sweep's task function): :func:`saopd.train.run_job`,
    which returns the run's summary (None if the sweep job failed)."""
    from saopd.train import run_job

    return run_job(cfg)


def eval_main() -> None:
    """``saopd-eval``: :func:`eval_app` on the command line's config."""
    _exit_on_yaml_problem("saopd-eval")
    eval_app()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="eval")
def eval_app(cfg: DictConfig) -> None:
    """The Hydra app of ``saopd-eval``: :func:`saopd.evaluate.run_job`."""
    from saopd.evaluate import run_job

    run_job(cfg)

