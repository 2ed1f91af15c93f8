"""Ranks as fresh interpreters (``python -c``): slow (each imports torch) but always available."""

from __future__ import annotations

import pickle
import subprocess
import sys

from nbaccel.launch.host.processes import WorkerProcess
from nbaccel.launch.launchers.base import ProcessLauncher
from nbaccel.launch.wire.protocol import LaunchKind
from nbaccel.launch.wire.spec import WorkerSpec

__all__ = ["SpawnLauncher"]

_BOOTSTRAP = (
    "import sys, pickle; sys.path[:] = pickle.loads(sys.stdin.buffer.read(int(sys.argv[1])));"
    "spec = pickle.loads(sys.stdin.buffer.read());"
    "from nbaccel.launch.rank.worker import run_worker; import os; os._exit(run_worker(spec))"
)


class SpawnLauncher(ProcessLauncher):
    """Start each rank with ``subprocess``; the spec goes through the child's stdin."""

    name = LaunchKind.SPAWN

    def start(self, spec: WorkerSpec) -> WorkerProcess:
        path = pickle.dumps(sys.path)
        popen = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, str(len(path))],
            stdin=subprocess.PIPE,
            close_fds=True,
        )
        popen.stdin.write(path + pickle.dumps(spec))
        popen.stdin.close()
        return WorkerProcess(popen.pid, self.name, popen=popen)
