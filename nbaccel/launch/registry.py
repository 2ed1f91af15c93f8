"""Every launcher variant, chosen in one place: :data:`LAUNCHERS` maps a launch kind to its class.

``forkserver`` (default on Linux/macOS), ``spawn``, ``fork`` and ``xla`` start ranks on this
machine; ``ssh`` and ``slurm`` start them on other hosts through one agent per host
(``nbaccel.launch.remote``).
"""

from __future__ import annotations

from typing import Any

from nbaccel.launch.launchers.base import ProcessLauncher
from nbaccel.launch.launchers.fork import ForkLauncher
from nbaccel.launch.launchers.forkserver import ForkServerLauncher
from nbaccel.launch.launchers.spawn import SpawnLauncher
from nbaccel.launch.launchers.xla import XlaLauncher
from nbaccel.launch.remote.slurm import SlurmLauncher
from nbaccel.launch.remote.ssh import SshLauncher

__all__ = ["LAUNCHERS", "ProcessLauncher", "make_launcher"]

LAUNCHERS: dict[str, type[ProcessLauncher]] = {
    ForkServerLauncher.name: ForkServerLauncher,
    SpawnLauncher.name: SpawnLauncher,
    ForkLauncher.name: ForkLauncher,
    XlaLauncher.name: XlaLauncher,
    SshLauncher.name: SshLauncher,
    SlurmLauncher.name: SlurmLauncher,
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
