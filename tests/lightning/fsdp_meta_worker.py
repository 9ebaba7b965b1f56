"""tests/integration/dist_worker.py's tiny run, recording which models each rank filled through
FSDP's meta-device path (not a test; launched by tests/lightning/test_fsdp_meta_init.py).

    python tests/lightning/fsdp_meta_worker.py OUT STRATEGY DEVICES [OVERRIDE ...]

Besides the worker's files, every rank writes OUT/materialized_rank<R>.json: the class names of
the models :meth:`OPDModule.configure_model` filled after sharding, in order. Lightning re-runs
this script for rank 1, so the recording applies on every rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.*

import saopd.lightning.module as module_code
from saopd.data_parallel import rank
from tests.integration import dist_worker

materialize = module_code.materialize_sharded
filled: list[str] = []


def recorded(model, device):
    filled.append(type(model).__name__)
    (Path(sys.argv[1]) / f"materialized_rank{rank()}.json").write_text(json.dumps(filled))
    return materialize(model, device)


module_code.materialize_sharded = recorded

if __name__ == "__main__":
    dist_worker.main()
