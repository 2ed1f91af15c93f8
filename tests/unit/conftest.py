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


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch):
    monkeypatch.setattr(os, "fork", _refuse("os.fork"))
    monkeypatch.setattr(os, "posix_spawn", _refuse("os.posix_spawn"))
    monkeypatch.setattr(_posixsubprocess, "fork_exec", _refuse("a subprocess"))
    monkeypatch.setattr(subprocess, "_fork_exec", _refuse("a subprocess"))  # bound at import
    from nbaccel.launch.launchers.forkserver import ForkServer

    for name in ("spawn", "spawn_many"):
        monkeypatch.setattr(ForkServer, name, _refuse(f"the fork server's {name}"))
