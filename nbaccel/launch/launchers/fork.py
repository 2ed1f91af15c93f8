"""Ranks forked from the driver itself: only when asked (the plan refuses it once CUDA is
initialised in the driver, since a forked child cannot use it)."""

from __future__ import annotations

import os

from nbaccel.launch.launchers.base import ProcessLauncher
from nbaccel.launch.processes import WorkerProcess
from nbaccel.launch.protocol import LaunchKind
from nbaccel.launch.spec import WorkerSpec

__all__ = ["ForkLauncher"]


class ForkLauncher(ProcessLauncher):
    """``os.fork`` per rank; the child runs the spec it inherited."""

    name = LaunchKind.FORK

    def start(self, spec: WorkerSpec) -> WorkerProcess:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 1
            try:
                from nbaccel.launch.worker import run_worker

                code = run_worker(spec)
            finally:
                os._exit(code)
        return WorkerProcess(pid, self.name)
