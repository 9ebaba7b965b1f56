"""Hydra's submitit launchers, with preemption and time limits that lose nothing.

SLURM (through submitit) signals a job ``signal_delay_s`` before its time limit, or when it is
preempted, with ``SIGUSR2`` (``$SUBMITIT_PREEMPT_SIGNAL``); ``submitit_local`` sends the same
signal. submitit's own handler would requeue at once, from inside whatever the job was doing
(an optimizer step half done). Here the signal is deferred to the training loop:

1. the handler marks the run preempted (:func:`saopd.runs.folder.request_preemption`) and
   raises ``SIGTERM`` for Lightning, so the step in progress finishes, is saved as ``last.ckpt``
   (:class:`saopd.runs.folder.PreemptionCheckpoint`) and the loop stops (``saopd-train``
   marks the MLflow run KILLED);
2. then submitit's handler runs: it calls :meth:`checkpoint`, which resubmits the same job with
   ``resume=auto`` (its own folder's ``last.ckpt``) when the job saved a checkpoint, and
   requeues it (SLURM: ``scontrol requeue``; local: the controller restarts it);
3. the requeued job resumes in its own folder, as the same run and MLflow run.

A job preempted before its first step ends is requeued without ``resume`` and starts again.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import (
    LocalLauncher as SubmititLocalLauncher,
)
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import (
    SlurmLauncher as SubmititSlurmLauncher,
)

log = logging.getLogger(__name__)


def preemption_signal() -> signal.Signals:
    """The signal submitit sends before a time limit or a preemption (``USR2`` unless
    ``$SUBMITIT_PREEMPT_SIGNAL`` names another)."""
    name = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2").upper().removeprefix("SIG")
    found = getattr(signal, f"SIG{name}", None)
    if not isinstance(found, signal.Signals):
        raise ValueError(f"SUBMITIT_PREEMPT_SIGNAL={name!r} is not a signal name (e.g. USR2)")
    return found


_JOB_FOLDER: list[Path] = []  # the preempted job's folder, for checkpoint()


def _defer(signum: int, frame: Any) -> None:
    """The preemption signal's handler while the job runs: finish the step, save it, stop."""
    log.warning("received %s: saving the current step, then requeueing",
                signal.Signals(signum).name)
    if HydraConfig.initialized():
        _JOB_FOLDER.append(Path(HydraConfig.get().runtime.output_dir))
    from saopd.runs.folder import request_preemption  # imported in the job: torch, Lightning

    request_preemption()
    signal.raise_signal(signal.SIGTERM)  # Lightning's handler: stop after this step


class _Requeueing:
    """The job side of both launchers (mixed into submitit's)."""

    def launch(self, job_overrides: Any, initial_job_idx: int) -> Any:
        """Submit the jobs; an option submitit's executor does not know is one line naming it
        (``hydra.launcher.<option>``) and exit status 2, not submitit's traceback."""
        try:
            return super().launch(job_overrides, initial_job_idx)  # type: ignore[misc]
        except NameError as err:
            found = re.match(r"Unknown argument '(\w+)' for executor '(\w+)'.*?"
                             r"Valid arguments: ([^\n]*)", str(err), re.S)
            if found is None:
                raise
            option, executor, valid = found.groups()
            shared = ", ".join(re.findall(r"'(\w+)': <class", str(err)))
            print(f"saopd-train: error: hydra.launcher.{option}: submitit's {executor!r} "
                  f"executor has no such option (its own: {valid}; the shared ones: "
                  f"{shared})", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    def __call__(self, sweep_overrides: list[str], *args: Any, **kwargs: Any) -> Any:
        usr = preemption_signal()
        requeue = signal.getsignal(usr)  # submitit's: checkpoint(), requeue, exit
        signal.signal(usr, _defer)
        try:
            return super().__call__(sweep_overrides, *args, **kwargs)  # type: ignore[misc]
        except SystemExit:  # saopd-train exits 143 after saving a preempted step
            from saopd.runs.folder import preemption_requested

            if not (preemption_requested() and callable(requeue)):
                raise
        requeue(usr, None)  # dumps checkpoint()'s resubmission, requeues, exits
        raise SystemExit(143)  # not reached: submitit's handler exits

    def checkpoint(self, sweep_overrides: list[str], *args: Any, **kwargs: Any) -> Any:
        """The same job again, resuming its own folder's ``last.ckpt`` when it saved one."""
        import submitit

        overrides = [o for o in sweep_overrides if not o.lstrip("+~").startswith("resume=")]
        if _JOB_FOLDER and (_JOB_FOLDER[-1] / "checkpoints" / "last.ckpt").exists():
            overrides.append("resume=auto")  # this job's own folder (find_resume)
        log.warning("requeueing the job (%s)", " ".join(overrides))
        return submitit.helpers.DelayedSubmission(self, overrides, *args, **kwargs)


class LocalLauncher(_Requeueing, SubmititLocalLauncher):
    """``hydra/launcher=submitit_local``: jobs as local processes through submitit."""


class SlurmLauncher(_Requeueing, SubmititSlurmLauncher):
    """``hydra/launcher=submitit_slurm``: jobs as SLURM jobs through submitit."""
