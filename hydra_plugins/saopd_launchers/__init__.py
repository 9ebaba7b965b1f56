"""saopd's Hydra launchers: Hydra's submitit launchers (SLURM, local) that save a preempted or
timed-out job's step and requeue it to resume exactly there, and a launcher that runs each job as
a Ray task (:mod:`.submitit_launchers`, :mod:`.ray_launcher`). Configs: ``conf/hydra/launcher/``.
Hydra finds launchers only in the ``hydra_plugins`` namespace, hence this package."""
