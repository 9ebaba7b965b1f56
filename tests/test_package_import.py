"""Importing saopd turns MLflow's usage telemetry off unless the user set it: its start-up thread
deleted an environment variable while tracking requests read the environment, and a request
failed with ``KeyError('_MLFLOW_TELEMETRY_SESSION_ID')`` (a failed sweep job's run stayed
RUNNING)."""

from __future__ import annotations

import os
import subprocess
import sys

#: Variables under which MLflow turns its telemetry off by itself (tests, CI services), removed
#: so that the child process is a user's shell.
QUIET = ("PYTEST_CURRENT_TEST", "GITHUB_ACTIONS", "CI", "CIRCLECI", "GITLAB_CI", "JENKINS_URL",
         "TRAVIS", "TF_BUILD", "BITBUCKET_BUILD_NUMBER", "CODEBUILD_BUILD_ARN", "BUILDKITE",
         "TEAMCITY_VERSION", "CLOUD_RUN_EXECUTION", "RUNBOT_HOST_URL", "RUNBOT_BUILD_NAME",
         "RUNBOT_WORKER_ID", "DO_NOT_TRACK", "MLFLOW_DISABLE_TELEMETRY")

PROBE = ("import os, sys\n"
         "if sys.argv[1] == 'saopd': import saopd\n"
         "import mlflow\n"
         "from mlflow.telemetry import get_telemetry_client\n"
         "print(os.environ.get('MLFLOW_DISABLE_TELEMETRY'), get_telemetry_client() is not None)\n")


def _probe(first: str, **env: str) -> list[str]:
    """``MLFLOW_DISABLE_TELEMETRY`` and whether MLflow made its telemetry client, in a fresh
    process that imports ``saopd`` (``first="saopd"``) or not before ``mlflow``."""
    clean = {k: v for k, v in os.environ.items() if k not in QUIET}
    out = subprocess.run([sys.executable, "-c", PROBE, first], capture_output=True, text=True,
                         timeout=120, env={**clean, **env}, check=True)
    return out.stdout.split()


def test_saopd_turns_mlflow_telemetry_off_and_keeps_a_users_choice() -> None:
    assert _probe("mlflow") == ["None", "True"]  # the guard: MLflow alone starts its telemetry
    assert _probe("saopd") == ["true", "False"]
    # a user's explicit choice is kept (here only read back: turning it on would go online)
    kept = subprocess.run([sys.executable, "-c", "import os, saopd; "
                           "print(os.environ['MLFLOW_DISABLE_TELEMETRY'])"],
                          capture_output=True, text=True, timeout=60, check=True,
                          env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "false"})
    assert kept.stdout.strip() == "false"
