"""Where a run's other processes live: trainer ranks 1..N-1 and the rollout workers.

A launcher starts them and gives the trainer the same handles whatever it is: a process
with multiprocessing.Process's methods (start, is_alive, join, terminate, kill, exitcode,
pid, name), a worker's inbox (`put`) and the read end of its messages (`recv`, an
EOFError once it is gone), and the weight transport (sync/). The controller, admission,
the staleness bound and fault handling above them are one code path.

    local  processes on this machine; weights through shared memory (launch/local.py)
    ray    actors on a Ray cluster's nodes; weights through its object store (launch/ray_cluster.py)

Ray is imported only when cluster.launcher=ray.
"""

from __future__ import annotations

from a3po.config import Config, ConfigError
from a3po.config.choices import Launcher


def check_ray(what: str) -> None:
    """One line, not an ImportError, where Ray is needed and missing."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ConfigError(f"{what} needs Ray, which is not installed here: pip install 'a3po[ray]' "
                          "(on every node of the cluster), or use cluster.launcher=local") from None


def check(cfg: Config) -> None:
    """Fail before any process starts when the launcher cannot be used at all."""
    if cfg.cluster.launcher == Launcher.RAY:
        check_ray("cluster.launcher=ray")


def make_launcher(cfg: Config, followers: int, per_worker: int, trainer_threads: int):
    """The launcher cluster.launcher names, holding what `followers` ranks and the rollout workers will take."""
    if cfg.cluster.launcher == Launcher.RAY:
        from a3po.launch.ray_cluster import RayLauncher

        return RayLauncher(cfg, followers, per_worker, trainer_threads)
    from a3po.launch.local import LocalLauncher

    return LocalLauncher()
