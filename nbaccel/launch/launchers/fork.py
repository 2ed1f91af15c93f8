"""Ranks forked from the driver itself: only when asked (the plan refuses it once CUDA is
initialised in the driver, since a forked child cannot use it)."""

from __future__ import annotations

import os
from multiprocessing import util as mp_util

from nbaccel.launch.host.processes import WorkerProcess
from nbaccel.launch.launchers.base import ProcessLauncher
from nbaccel.launch.rank.inherited import note_inherited
from nbaccel.launch.wire.protocol import LaunchKind
from nbaccel.launch.wire.spec import WorkerSpec

__all__ = ["ForkLauncher"]


class ForkLauncher(ProcessLauncher):
    """``os.fork`` per rank; the child runs the spec it inherited."""

    name = LaunchKind.FORK
    forks_driver = True

    def start(self, spec: WorkerSpec) -> WorkerProcess:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 1
            try:
                # as multiprocessing's own fork children: inherited queues and locks reset
                # their threads and state, and the child's queue feeders flush before exit
                mp_util._finalizer_registry.clear()
                mp_util._run_after_forkers()
                note_inherited()
                from nbaccel.launch.rank.worker import run_worker

                code = run_worker(spec)
                mp_util._exit_function()
            finally:
                os._exit(code)
        return WorkerProcess(pid, self.name)
