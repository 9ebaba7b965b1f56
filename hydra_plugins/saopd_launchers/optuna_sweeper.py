"""Hydra's Optuna sweeper, ending a search where no trial completed with its summary.

Hydra's Optuna sweeper asks Optuna for the best trial once every trial has run; when none
completed (every trial failed, each recorded as failed) Optuna raises ``ValueError: No trials
are completed yet.``, and Hydra then skips its callbacks' end of the sweep: no
``sweep_summary.json``, no ``best.json``, a raw traceback. This sweeper ends such a search like
any other: the callbacks' ends run (:class:`saopd.search.SearchObjectives` records that there
is no best point and lists why the trials failed; :class:`saopd.runs.sweeps.SweepSummary` writes the
sweep's summary and exits with status 1). ``conf/hparams_search/*.yaml`` name it as
``hydra.sweeper._target_``.

With a ``storage`` (the configs keep the study in ``<sweep dir>/optuna.db``) a search continues
the study stored there: ``n_trials`` counts its trials, old and new, a trial a killed search
left running is marked failed, job numbers continue after the stored trials, and the sampler
is reseeded (:func:`saopd.search.resume_plan`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import (
    OptunaSweeper as HydraOptunaSweeper,
)

log = logging.getLogger(__name__)

#: Optuna's words when it is asked for the best trial of a study without a completed one (in
#: memory; a study in a database storage says the second).
NO_COMPLETED_TRIAL = "No trials are completed yet"
NO_RECORD = "Record does not exist"


def interval_problem(overrides: Sequence[str]) -> str | None:
    """The first search-space override (``key=interval(low, high)``, from the command line or
    ``hydra.sweeper.params``) whose low end is above its high end, as one line naming the key;
    None when there is none (Optuna's own error named neither)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import IntervalSweep

    parser = OverridesParser.create()
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
            value = override.value()
        except Exception:  # not ours to judge: Hydra reports what it cannot parse
            continue
        if isinstance(value, IntervalSweep) and value.start > value.end:
            return (f"{override.key_or_group}=interval({value.start}, {value.end}): the low end "
                    f"is above the high end; write interval({value.end}, {value.start})")
    return None


class OptunaSweeper(HydraOptunaSweeper):
    """``hydra/sweeper=optuna`` whose search ends normally when no trial completed, and
    continues the study of its storage."""

    def _resume(self) -> None:
        """Open the stored study, if any (a SQLite file is prepared first:
        :func:`saopd.search.prepare_sqlite_storage`), and set the trials still to run and the
        first job number (:func:`saopd.search.resume_plan`)."""
        impl = self.sweeper  # Hydra's sweeper does the work; this class wraps it
        if not impl.storage:
            return
        import optuna

        from saopd.search import prepare_sqlite_storage, resume_plan

        prepare_sqlite_storage(impl.storage)
        study = optuna.create_study(study_name=impl.study_name, storage=impl.storage,
                                    directions=impl._get_directions(), load_if_exists=True)
        plan = resume_plan(study, impl.n_trials)
        if plan.finished or plan.interrupted:
            print(f"hparams search: resuming study {impl.study_name!r} of {impl.storage}: "
                  f"{plan.finished} trial(s) done, {plan.interrupted} interrupted (marked "
                  f"failed), {plan.to_run} of n_trials={impl.n_trials} to run", flush=True)
            reseed = getattr(impl.sampler, "reseed_rng", None)
            if reseed is not None:  # or its random start would propose the first trials again
                reseed()
        impl.n_trials, impl.job_idx = plan.to_run, plan.next_job

    def sweep(self, arguments: list[str]) -> Any:
        """Run the search; a search whose every trial failed returns (its trials are recorded
        as failed; the callbacks report them) instead of raising Optuna's ``ValueError``. A
        reversed interval in the search space is refused first (one line, exit 2)."""
        params = getattr(self.sweeper, "params", None) or {}
        problem = interval_problem([*arguments, *(f"{k}={v}" for k, v in params.items())])
        if problem is not None:
            print(f"saopd-train: error: {problem}", file=sys.stderr, flush=True)
            raise SystemExit(2)
        self._resume()
        try:
            return super().sweep(arguments)
        except ValueError as err:
            if NO_COMPLETED_TRIAL not in str(err) and NO_RECORD not in str(err):
                raise
            log.warning("hparams search: no trial completed, so there is no best point")
            return None
