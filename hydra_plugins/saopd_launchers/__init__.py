"""saopd's Hydra plugins: Hydra's submitit launchers (SLURM, local) that save a preempted or
timed-out job's step and requeue it to resume exactly there (:mod:`.submitit_launchers`), Hydra's
Ray launcher with its local cluster on loopback (:mod:`.ray_launcher`; configs of both in
``conf/hydra/launcher/``), and Hydra's Optuna sweeper ending a search where no trial completed
with its summary (:mod:`.optuna_sweeper`, named by ``conf/hparams_search/*.yaml``). Hydra finds
plugins only in the ``hydra_plugins`` namespace, hence this package."""
