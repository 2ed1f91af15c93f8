"""The unit tier starts no process: a test here that forks, spawns or asks the fork server for a
rank fails, naming the tier it belongs to (tests/ranks, tests/kernel)."""

from __future__ import annotations

import _posixsubprocess
import os
import subprocess

import pytest


class StartsProcesses(AssertionError):
    """A unit-tier test started a process."""


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise StartsProcesses(
            f"a unit-tier test started a process ({what}): move it to tests/ranks (ranks, "
            "subprocesses) or tests/kernel (Jupyter kernels)"
        )

    return refuse


def _build_first_use_caches() -> None:
    """Build the caches third-party libraries make on first use by starting a process, so that a
    test touching them passes on a fresh home directory as it does on a used one.

    matplotlib lists the system fonts with ``fc-list`` the first time its font manager loads
    (then keeps the list in ``MPLCONFIGDIR``, ``~/.cache/matplotlib`` by default): loaded here,
    before any test's guard is in place, that process is the session's, not a test's.
    """
    try:
        import matplotlib.font_manager  # noqa: F401  (builds the font cache on import)
    except ImportError:
        pass


@pytest.fixture(scope="session", autouse=True)
def _first_use_caches() -> None:
    """Once per session, before the first test's guard: see :func:`_build_first_use_caches`."""
    _build_first_use_caches()


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch, _first_use_caches):
    monkeypatch.setattr(os, "fork", _refuse("os.fork"))
    monkeypatch.setattr(os, "posix_spawn", _refuse("os.posix_spawn"))
    monkeypatch.setattr(_posixsubprocess, "fork_exec", _refuse("a subprocess"))
    monkeypatch.setattr(subprocess, "_fork_exec", _refuse("a subprocess"))  # bound at import
    from nbaccel.launch.launchers.forkserver.launcher import ForkServer

    for name in ("spawn", "spawn_many"):
        monkeypatch.setattr(ForkServer, name, _refuse(f"the fork server's {name}"))
