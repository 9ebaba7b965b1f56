"""Command line of the DVC stages: ``python -m saopd.stages <stage> --params params.yaml``.

``<stage>`` is a name registered in :data:`saopd.stages.common.STAGES` (the ``dvc.yaml`` stage
names); relative paths in the params file are taken from the params file's folder. Exits 1 with
a one-line ``error: ...`` on a :class:`~saopd.stages.common.PrepareError`, and 2 (with the
registered names) on an unknown stage.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from saopd.stages import STAGES
from saopd.stages.common import PrepareError, load_params

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run one stage: ``main(["prepare_eval", "--params", "params.yaml"])``; returns the exit
    status (0, or 1 after printing ``error: <message>`` for a :class:`PrepareError`)."""
    parser = argparse.ArgumentParser(
        prog="python -m saopd.stages", description="Run one stage of the DVC pipeline (dvc.yaml)."
    )
    parser.add_argument("stage", choices=STAGES.names(), help="the dvc.yaml stage name")
    parser.add_argument("--params", default="params.yaml",
                        help="YAML params file; relative paths in it are taken from its folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    params_path = Path(args.params)
    stage = STAGES.get(args.stage)
    try:
        stage(load_params(params_path), params_path.resolve().parent)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
