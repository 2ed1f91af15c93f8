"""Every launcher variant, chosen in one place: :data:`LAUNCHERS` maps a launch kind to its class.

``forkserver`` (default on Linux/macOS), ``spawn``, ``fork`` and ``xla`` start ranks on this
machine; ``ssh``, ``slurm`` and ``ray`` start them on other hosts through one agent per host
(``nbaccel.launch.remote``; Ray's in ``nbaccel.launch.remote.ray``, Ray imported only when used).
"""

from __future__ import annotations

from typing import Any

from nbaccel.launch.launchers.base import ProcessLauncher
from nbaccel.launch.launchers.fork import ForkLauncher
from nbaccel.launch.launchers.forkserver.launcher import ForkServerLauncher
from nbaccel.launch.launchers.spawn import SpawnLauncher
from nbaccel.launch.launchers.xla import XlaLauncher
from nbaccel.launch.remote.launcher import RemoteLauncher
from nbaccel.launch.remote.options import RemoteOptions
from nbaccel.launch.remote.ray.launcher import RayLauncher
from nbaccel.launch.remote.slurm import SlurmLauncher
from nbaccel.launch.remote.ssh import SshLauncher

__all__ = ["LAUNCHERS", "ProcessLauncher", "make_launcher", "place_remote"]

LAUNCHERS: dict[str, type[ProcessLauncher]] = {
    ForkServerLauncher.name: ForkServerLauncher,
    SpawnLauncher.name: SpawnLauncher,
    ForkLauncher.name: ForkLauncher,
    XlaLauncher.name: XlaLauncher,
    SshLauncher.name: SshLauncher,
    SlurmLauncher.name: SlurmLauncher,
    RayLauncher.name: RayLauncher,
}


def make_launcher(kind: str, **options: Any) -> ProcessLauncher:
    """The launcher for ``kind`` (a key of :data:`LAUNCHERS`), built with ``options``."""
    try:
        cls = LAUNCHERS[kind]
    except KeyError:
        raise ValueError(
            f"unknown launch kind {kind!r}; choose one of {', '.join(LAUNCHERS)}."
        ) from None
    return cls(**options)


def place_remote(remote: RemoteOptions, pool: bool) -> RemoteOptions:
    """``remote`` with its hosts known: the variant's scheduler places the ranks now (Ray), or
    they were given (ssh, SLURM). Raises before anything of the launch starts."""
    cls = LAUNCHERS.get(remote.kind)
    if cls is not None and issubclass(cls, RemoteLauncher):
        return cls.placed(remote, pool)
    return remote
