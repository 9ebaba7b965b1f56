"""The DVC pipeline's stages (``dvc.yaml``): prepared training prompts and benchmarks, written
atomically and reproducibly from ``params.yaml``. Run one with
``python -m saopd.stages <stage> --params params.yaml`` (:mod:`saopd.stages.__main__`).

Modules: :mod:`~saopd.stages.common` (the :data:`STAGES` registry, errors, reports, input checks,
params helpers, the seeded sampler), :mod:`~saopd.stages.math` (``prepare_eval``,
``prepare_train``), :mod:`~saopd.stages.synth_vqa` (``prepare_vlm``),
:mod:`~saopd.stages.paper_vlm` (``prepare_vlm_understanding``, ``prepare_vlm_reasoning``) and
:mod:`~saopd.stages.vlm_eval` (``prepare_vlm_eval``), the last two reading hub/local tables
(:mod:`~saopd.stages.readers`) and writing rows with images (:mod:`~saopd.stages.vlm_rows`).

Importing this package registers every stage. None of the stage modules imports torch, PIL,
pyarrow or ``datasets`` at import time: a stage imports what it needs when it runs.

Adding a stage: a function ``(params, root) -> report`` decorated
``@STAGES.register("<dvc.yaml name>")`` in a module of this package, that module in the import
line below, its entry in ``dvc.yaml`` (``cmd: python -m saopd.stages <name> --params
params.yaml``) and a test.
"""

from saopd.stages import math, paper_vlm, synth_vqa, testbed, vlm_eval  # noqa: F401  (registration)
from saopd.stages.common import STAGES, PrepareError, Stage, StageReport

__all__ = ["STAGES", "PrepareError", "Stage", "StageReport"]
