"""The actor that holds one rank's bundle of the launch's placement group.

It keeps the bundle's resources (and, for GPUs, the devices Ray assigned it) reserved for its
rank. The first keeper of each node also runs that node's agent (``python -m
nbaccel.launch.remote.agent``, its configuration on stdin as over ssh): the agent forks the
node's ranks from its torch-preloaded server. The agent's stdin stays open as long as the keeper
lives, so a keeper that dies (killed, its node lost, the kernel's job ended) closes it, and the
agent kills its ranks and exits: nothing outlives the reservation.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections import deque
from typing import Any

import ray

from nbaccel.launch.remote.launcher import AGENT_MODULE

__all__ = ["Keeper"]


class Keeper:
    """One rank's reservation; on its node's first rank, the node's agent too."""

    def __init__(self) -> None:
        self._popen: subprocess.Popen | None = None
        self._started = threading.Event()
        self._tail: deque[str] = deque(maxlen=20)
        self._reader: threading.Thread | None = None

    def info(self) -> dict[str, Any]:
        """Where it runs and what Ray gave it."""
        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
        }

    def start_agent(self, config: dict[str, Any], python: str, cwd: str) -> int:
        """Start the node's agent; its pid."""
        self._popen = subprocess.Popen(
            [python or sys.executable, "-m", AGENT_MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=cwd if os.path.isdir(cwd) else None,
            start_new_session=True,  # the stop button reaches ranks through the kernel
        )
        assert self._popen.stdin is not None
        self._popen.stdin.write(json.dumps(config).encode() + b"\n")
        self._popen.stdin.flush()
        self._reader = threading.Thread(target=self._collect, daemon=True)
        self._reader.start()
        self._started.set()
        return self._popen.pid

    def _collect(self) -> None:
        assert self._popen is not None and self._popen.stdout is not None
        for raw in iter(self._popen.stdout.readline, b""):
            self._tail.append(raw.decode("utf-8", "replace").rstrip())

    def wait_agent(self) -> tuple[int, list[str]]:
        """Block until the agent ends: its exit code and last lines."""
        self._started.wait()
        assert self._popen is not None
        code = self._popen.wait()
        if self._reader is not None:
            self._reader.join(2.0)
        return code, list(self._tail)

    def signal_agent(self, sig: int) -> None:
        """Send ``sig`` to the agent (SIGTERM: it stops its ranks and exits)."""
        if self._popen is not None and self._popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._popen.send_signal(signal.Signals(sig))


@functools.cache
def keeper_class() -> Any:
    """The actor class (threaded: waiting for the agent does not block the other calls); made
    once, when Ray is first used."""
    return ray.remote(max_concurrency=4, max_restarts=0)(Keeper)
