"""The kernel's handle on a rank that runs on another host.

It offers what the worker group asks of every process handle (``pid``, ``poll``,
``signal_tree``, ``ended_at``, ``lost``): the exit is what the host's agent reported; signals
are forwarded to the agent, which signals the rank's process tree there; a lost host ends every
rank on it at once, with the host named in ``lost``.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable

__all__ = ["RemoteProcess"]


class RemoteProcess:
    """One rank on host ``host``; ``send_signal(rank, sig, tree)`` reaches its agent."""

    def __init__(
        self,
        rank: int,
        host: str,
        method: str,
        send_signal: Callable[[int, int, bool], None],
        error_path: str | None = None,
    ) -> None:
        self.rank = rank
        self.host = host
        self.method = method
        self.pid: int | None = None  # on its host, once the agent reported it
        self.ended_at: float | None = None
        self.lost = ""
        self._returncode: int | None = None
        self._send_signal = send_signal
        self._error_path = error_path

    def started(self, pid: int) -> None:
        self.pid = pid

    def exited(self, code: int, at: float, detail: str = "") -> None:
        """The agent saw the rank end (``detail``: why it could not connect, if it wrote it)."""
        if self._returncode is not None:
            return
        if detail and self._error_path:  # where the worker group looks for a rank's last words
            with contextlib.suppress(OSError), open(self._error_path, "w") as handle:
                handle.write(f"{detail} (on host {self.host})")
        self.ended_at = at
        self._returncode = code

    def host_lost(self, why: str) -> None:
        """The rank's host (or the connection to it) is gone: the rank is gone with it."""
        if self._returncode is None:
            self.lost = f"host {self.host} lost: {why}"
            self.ended_at = time.time()
            self._returncode = -int(signal.SIGKILL)

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while running."""
        return self._returncode

    def ignores(self, sig: int) -> bool:
        """Unknown on another host (its ``/proc`` is not here): assume it may react."""
        return False

    def signal_tree(self, sig: int) -> None:
        """Send ``sig`` to the rank and its children, on its host."""
        if self._returncode is None:
            self._send_signal(self.rank, int(sig), True)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the rank alone, on its host."""
        if self._returncode is None:
            self._send_signal(self.rank, int(sig), False)
