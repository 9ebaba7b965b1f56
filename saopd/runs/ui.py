"""saopd's MLflow experiments as the MLflow 3 UI shows them: model training, not GenAI.

MLflow 3's UI has two views of an experiment: GenAI (traces, an overview of LLM calls) and model
training (runs, metric charts). Two things decide which one opens:

- the experiment tag :data:`EXPERIMENT_KIND_TAG` (``mlflow.experimentKind``), MLflow's declared
  kind of an experiment. saopd sets it to :data:`MODEL_TRAINING` when it creates an experiment
  (:func:`get_or_create_experiment`). MLflow 3.17.2's UI no longer routes by it (read in its
  built UI code: the kind comes from the view switch below), but the tag still records what the
  experiment is, and UIs that route by it open the runs;
- the UI's "GenAI | Model training" switch, which the browser remembers and which starts on
  GenAI, and the ``workflowType`` parameter of the page's address, which overrides it. The links
  of :func:`experiment_url` carry ``workflowType=machine_learning`` and open the experiment's runs
  as metric charts whatever the switch says (checked in Chromium:
  ``tests/integration/test_mlflow_ui_browser.py``).

What the charts open on. The UI's chart view makes a chart per metric, grouped in sections by
the metric's prefix in alphabetical order. MLflow stores a view of an experiment (charts,
sections) as the experiment tag ``mlflow.sharedViewState.<key>``, which an address with
``viewStateShareKey=<key>`` opens (the UI's "Share" button writes such tags).
:func:`set_key_charts` writes the view :data:`KEY_CHARTS_VIEW`: a first section "Key metrics"
with line charts of the held-out accuracy, the loss, FLMR and the filtered ratio over steps (the
other metrics follow in their sections), and ``experiment_url(..., view=KEY_CHARTS_VIEW)`` opens
it. Training sets it on its experiment (:mod:`saopd.runs.logger`).

Printed commands. :func:`console_command` names a console script of this environment by its
absolute path (``.venv/bin/mlflow``), so that a printed command works in a fresh shell where
the environment is not activated; :func:`ui_command` is the ``mlflow ui`` command of a store.

Nothing here imports MLflow: the functions take an ``MlflowClient`` (or anything with its
methods) and build strings.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

__all__ = [
    "EXPERIMENT_KIND_TAG",
    "KEY_CHARTS_VIEW",
    "KEY_METRICS",
    "MODEL_TRAINING",
    "SWEEP_PARENT_TAG",
    "console_command",
    "experiment_url",
    "get_or_create_experiment",
    "key_charts_state",
    "set_key_charts",
    "ui_command",
]

#: The experiment tag holding MLflow 3's experiment kind.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
#: Its value for model training ("Machine learning" in the UI; the other is genai_development).
MODEL_TRAINING = "custom_model_development"
#: Tag of a sweep's (or a search's) parent run, ``true``: the run its jobs' runs are children
#: of (saopd.runs.sweeps); it holds no metrics of its own, and reports leave it out.
SWEEP_PARENT_TAG = "saopd.sweep_parent"
#: The UI's view parameter: ``machine_learning`` (model training) or ``genai``.
_VIEW = {"workflowType": "machine_learning"}
#: The key of saopd's stored chart view (experiment tag ``mlflow.sharedViewState.<key>``).
KEY_CHARTS_VIEW = "saopd-key-metrics"
_VIEW_TAG = "mlflow.sharedViewState."
#: The training metrics of the key charts, after the held-out accuracy: the loss, FLMR
#: (Eq. 17) and the share of tokens the filter removed.
KEY_METRICS = ("train/loss", "train/flmr", "train/filtered_ratio")
_SECTION = "saopd-key-metrics-section"


def get_or_create_experiment(client: Any, name: str, *,
                             artifact_location: str | None = None) -> str:
    """The id of MLflow experiment ``name``, created as model training if missing.

    ``artifact_location`` is used only when the experiment is created (``None``: the store's
    default; a tracking server's own artifact root). An existing experiment without a kind tag
    gets :data:`MODEL_TRAINING`. Safe when several processes create the same experiment at once
    (sweep jobs on several nodes through one tracking server): the loser of the race reads the
    winner's experiment. A deleted experiment of that name is refused (``ValueError``), since
    MLflow keeps its name taken until it is restored or purged.
    """
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location,
                                            tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING})
        except Exception as err:  # MlflowException; another process created it meanwhile
            if getattr(err, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
                raise
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        raise ValueError(f"MLflow experiment {name!r} (id {exp.experiment_id}) is deleted; "
                         f"restore it (mlflow experiments restore --experiment-id "
                         f"{exp.experiment_id}) or use another experiment name")
    if EXPERIMENT_KIND_TAG not in (exp.tags or {}):
        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
    return exp.experiment_id


def experiment_url(server_url: str, experiment_id: str | None = None, *,
                   charts: bool = True, view: str | None = None) -> str:
    """The MLflow UI's address of an experiment's runs in the model-training view.

    ``server_url``: the UI's base address (``http://127.0.0.1:5000``). ``experiment_id`` None:
    the list of experiments, in that view. ``charts``: the runs as metric charts (else as a
    table). ``view``: a stored view of the experiment to open (:data:`KEY_CHARTS_VIEW`, which
    :func:`set_key_charts` stored), with charts.
    """
    base = server_url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"server_url must be an http(s) address, got {server_url!r}")
    if experiment_id is None:
        return f"{base}/#/experiments?{urlencode(_VIEW)}"
    query = {**_VIEW, **({"compareRunsMode": "CHART"} if charts else {}),
             **({"viewStateShareKey": view} if view and charts else {})}
    return f"{base}/#/experiments/{experiment_id}/runs?{urlencode(query)}"


def key_charts_state(metrics: Sequence[str]) -> dict[str, Any]:
    """The UI state of :data:`KEY_CHARTS_VIEW`: the runs as charts, a first section "Key
    metrics" with a line chart (over steps) of each of ``metrics``, in order; up to 50 runs
    drawn per chart (a sweep's jobs)."""
    charts = [{"uuid": f"saopd-key-{i}", "type": "LINE", "runsCountToCompare": 50,
               "metricSectionId": _SECTION, "deleted": False, "isGenerated": False,
               "displayName": key, "metricKey": key, "selectedMetricKeys": [key],
               "lineSmoothness": 0, "xAxisScaleType": "linear", "scaleType": "linear",
               "range": {}, "xAxisKey": "step", "selectedXAxisMetricKey": "",
               "yAxisKey": "METRIC", "yAxisExpressions": [], "ignoreOutliers": False,
               "useGlobalXaxisKey": True, "useGlobalLineSmoothing": True}
              for i, key in enumerate(metrics)]
    section = {"uuid": _SECTION, "name": "Key metrics", "display": True, "isReordered": False,
               "deleted": False, "isGenerated": False}
    return {"compareRunsMode": "CHART", "compareRunCharts": charts,
            "compareRunSections": [section], "isAccordionReordered": True,
            "hideEmptyCharts": True}


def set_key_charts(client: Any, experiment_id: str, metrics: Sequence[str]) -> bool:
    """Store :data:`KEY_CHARTS_VIEW` of ``metrics`` (:func:`key_charts_state`) on the
    experiment, unless it holds that view already; True when it wrote the tag."""
    value = json.dumps(key_charts_state(metrics), separators=(",", ":"))
    tag = _VIEW_TAG + KEY_CHARTS_VIEW
    if (client.get_experiment(experiment_id).tags or {}).get(tag) == value:
        return False
    client.set_experiment_tag(experiment_id, tag, value)
    return True


def console_command(name: str) -> str:
    """Console script ``name`` as a printed command that works in a fresh shell: its absolute
    path when this environment has it (beside this Python: ``/repo/.venv/bin/mlflow``), else
    the bare name."""
    path = Path(sys.executable).parent / name  # not resolved: a venv's python is a link
    return str(path.absolute()) if path.is_file() else name


def ui_command(tracking_uri: str, *, port: int | None = None) -> str:
    """The ``mlflow ui`` command that browses ``tracking_uri`` on 127.0.0.1 (MLflow's port 5000
    unless ``port``), with this environment's ``mlflow`` (:func:`console_command`)."""
    words = [console_command("mlflow"), "ui", "--backend-store-uri", tracking_uri,
             "--host", "127.0.0.1", *(["--port", str(port)] if port else [])]
    return " ".join(shlex.quote(w) for w in words)
