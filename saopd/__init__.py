"""saopd: spurious-signal-aware on-policy distillation (SA-OPD) and its baselines.

Importing saopd turns MLflow's usage telemetry off for this process and the ones it starts,
unless ``MLFLOW_DISABLE_TELEMETRY`` is already set (``MLFLOW_DISABLE_TELEMETRY=false`` keeps it
on). At ``import mlflow`` the telemetry starts a thread that fetches its configuration from the
internet; where that fails (an offline machine, a firewalled cluster) the thread deletes an
environment variable while the tracking client's requests read the environment (their proxy
settings), and a request failed with ``KeyError('_MLFLOW_TELEMETRY_SESSION_ID')``: a failed
sweep job's run was left RUNNING so. docs/tracking.md says more.
"""

import os

__version__ = "0.1.0"

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
