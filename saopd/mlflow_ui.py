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

Nothing here imports MLflow: the functions take an ``MlflowClient`` (or anything with its
methods) and build strings.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

__all__ = [
    "EXPERIMENT_KIND_TAG",
    "MODEL_TRAINING",
    "experiment_url",
    "get_or_create_experiment",
]

#: The experiment tag holding MLflow 3's experiment kind.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
#: Its value for model training ("Machine learning" in the UI; the other is genai_development).
MODEL_TRAINING = "custom_model_development"
#: The UI's view parameter: ``machine_learning`` (model training) or ``genai``.
_VIEW = {"workflowType": "machine_learning"}


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
                   charts: bool = True) -> str:
    """The MLflow UI's address of an experiment's runs in the model-training view.

    ``server_url``: the UI's base address (``http://127.0.0.1:5000``). ``experiment_id`` None:
    the list of experiments, in that view. ``charts``: the runs as metric charts (else as a
    table).
    """
    base = server_url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"server_url must be an http(s) address, got {server_url!r}")
    if experiment_id is None:
        return f"{base}/#/experiments?{urlencode(_VIEW)}"
    query = {**_VIEW, **({"compareRunsMode": "CHART"} if charts else {})}
    return f"{base}/#/experiments/{experiment_id}/runs?{urlencode(query)}"
