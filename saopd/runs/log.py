"""What a run's log leaves out: the warnings a run meets by design or from its libraries
(:data:`KNOWN_WARNINGS`) and Lightning's adverts for its cloud packages (:class:`AdvertFilter`).
:func:`quiet_known_noise` filters both; importing :mod:`saopd.lightning.trainer` calls it."""

from __future__ import annotations

import logging
import warnings

__all__ = ["KNOWN_WARNINGS", "RANK_ZERO_LOGGERS", "AdvertFilter", "quiet_known_noise"]

#: Lightning's loggers of ``rank_zero_info`` (the fabric's or the trainer's, whichever was set
#: last), where its tips are logged.
RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero",
                     "lightning.fabric.utilities.rank_zero")
#: Warnings that a run meets by design or from its libraries, each as (message regex, module
#: regex or "" for any, why it is not the user's business).
KNOWN_WARNINGS = (
    (r".*module\(s\) in eval mode.*", "", "the frozen teacher stays in eval mode"),
    (r".*pre-optimization state was saved.*", "",
     "checkpoints hold the weights after each step's update (manual optimization): what "
     "resuming needs"),
    (r".*your dataloader is not resumable.*", "",
     "a step's prompts are a function of the step: the loader needs no state to resume"),
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"lightning\.pytorch\.utilities\._pytree",
     "torch's deprecation met inside Lightning's own code (its _pytree helper)"),
)


class AdvertFilter(logging.Filter):
    """Drops Lightning's adverts for its cloud packages (the ``💡 Tip: ... install
    [litlogger]`` / ``[litmodels]`` lines every ``Trainer`` logs), nothing else."""

    PACKAGES = ("pypi.org/project/litlogger/", "pypi.org/project/litmodels/")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("💡 Tip:") and any(p in message for p in self.PACKAGES))


def quiet_known_noise() -> None:
    """Filter :data:`KNOWN_WARNINGS` and Lightning's adverts (:class:`AdvertFilter`, on the
    :data:`RANK_ZERO_LOGGERS`) out of the run's output; idempotent."""
    for message, module, _why in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, module=module)
    for name in RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, AdvertFilter) for f in logger.filters):
            logger.addFilter(AdvertFilter())
