"""A run's life: its folder (identity, lock, records), resume, checkpoints, the MLflow logger and
run status, UI links, the tracking server and sweep records.

The modules sit on different layers (``[tool.importlinter]`` in ``pyproject.toml``):
:mod:`saopd.runs.ui` imports nothing of saopd, so this package's ``__init__`` imports nothing
either.
"""
