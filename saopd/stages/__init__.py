"""The DVC pipeline's stages (``dvc.yaml``): prepared training prompts and benchmarks, written
atomically and reproducibly from ``params.yaml``. Run one with
``python -m saopd.stages.prepare <stage> --params params.yaml``."""
