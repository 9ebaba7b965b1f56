"""Hydra's Ray launcher, with the local Ray cluster it starts listening on loopback only.

``hydra/launcher=ray_cluster`` without ``ray.init.address`` starts a Ray cluster on this machine
for the sweep. Ray binds the cluster's servers (GCS, raylet, workers, the dashboard and runtime
environment agents) to the node's address, which on Linux is the machine's network address (the
GCS, raylets and workers on every interface), so anyone who reaches the machine could reach the
cluster for the sweep's duration. Ray takes the loopback address as the node's address where it
does not support multi-node clusters (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, its default on
macOS and Windows): this launcher sets that for a local cluster before Ray is imported, so every
listener of the cluster is on 127.0.0.1. A cluster given by address (``auto``,
``ray://head:10001``) is Ray's own and left as it is: it belongs on a trusted network.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from hydra_plugins.hydra_ray_launcher.ray_launcher import RayLauncher as HydraRayLauncher

log = logging.getLogger(__name__)

#: Ray's switch for clusters of several nodes; "0" makes the node's address the loopback one.
MULTI_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def starts_local_cluster(ray_cfg: Mapping[str, Any]) -> bool:
    """True when the Ray launcher config ``ray_cfg`` starts a cluster on this machine
    (``init.address`` null, empty or ``local``) rather than joining one."""
    init = ray_cfg.get("init") or {}
    return init.get("address") in (None, "", "local")


def keep_on_loopback() -> None:
    """Make the Ray cluster this process starts listen on 127.0.0.1 only (see the module's
    doc). Raises ``RuntimeError`` when Ray was imported already (it read the switch then)."""
    if os.environ.get(MULTI_NODE_ENV) == "0":
        return
    if "ray" in sys.modules:
        raise RuntimeError(f"ray was imported before the sweep started, so its local cluster "
                           f"would listen on every interface; set {MULTI_NODE_ENV}=0 in the "
                           "environment (or give hydra.launcher.ray.init.address)")
    os.environ[MULTI_NODE_ENV] = "0"


class RayLauncher(HydraRayLauncher):
    """``hydra/launcher=ray_cluster``: each job a Ray task; a local cluster on loopback."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any:
        """Keep a local cluster on loopback (:func:`keep_on_loopback`), then launch as Hydra's
        Ray launcher does."""
        if starts_local_cluster(self.ray_cfg):
            keep_on_loopback()
            log.info("local Ray cluster: listening on 127.0.0.1 only")
        return super().launch(job_overrides, initial_job_idx)
