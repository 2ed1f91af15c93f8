"""Everything a rank starts ends with it: the fork server adopts and ends a rank's descendants.

Linux lets a process declare itself a *child subreaper* (``PR_SET_CHILD_SUBREAPER``): orphans
among its descendants are re-parented to it instead of to init. The fork server and every rank
it forks are subreapers. While a rank lives, the processes it started (DataLoader workers,
``subprocess`` children, double-forked daemons) stay below it; when the rank ends, however it
ends (returned, raised, SIGKILLed), they are re-parented to the fork server, which therefore
knows that any child it did not fork itself belongs to a rank that is gone, and ends it: SIGTERM,
then SIGKILL after :data:`KILL_AFTER` seconds.

A process meant to outlive its launch opts out: start it with ``NBACCEL_DETACH=1`` in the
environment it is *executed* with (``subprocess.Popen(cmd, env={**os.environ,
"NBACCEL_DETACH": "1"}, start_new_session=True)``); the server then leaves it alone. Elsewhere
than Linux (no subreapers) the driver's tree kill at stop time is all there is.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import signal
import time
from typing import Any

__all__ = ["DETACH_ENV", "KILL_AFTER", "Reaper", "become_subreaper"]

_PR_SET_CHILD_SUBREAPER = 36
DETACH_ENV = "NBACCEL_DETACH"
KILL_AFTER = 1.0  # s between SIGTERM and SIGKILL for an orphan


@functools.cache
def _prctl() -> Any:
    """libc's prctl, looked up once: the fork server's ranks inherit it ready."""
    return ctypes.CDLL(None, use_errno=True).prctl


def become_subreaper() -> bool:
    """Adopt this process's orphaned descendants (Linux); False where unsupported."""
    if not os.path.exists("/proc/self"):
        return False
    try:
        return _prctl()(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _children() -> set[int]:
    """This process's direct children (every thread's, as Linux lists them)."""
    paths = glob.glob("/proc/self/task/*/children")
    if not paths:  # a kernel built without CONFIG_PROC_CHILDREN: scan /proc instead
        import psutil

        return {child.pid for child in psutil.Process().children()}
    pids: set[int] = set()
    for path in paths:
        try:
            with open(path) as handle:
                pids.update(int(pid) for pid in handle.read().split())
        except (OSError, ValueError):
            continue
    return pids


def _detached(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return f"{DETACH_ENV}=1".encode() in handle.read().split(b"\0")
    except OSError:
        return True  # gone already, or not ours to read: leave it


class Reaper:
    """The fork server's bookkeeping: its ranks, their exit codes, and adopted orphans."""

    def __init__(self) -> None:
        self.ranks: set[int] = set()
        self._doomed: dict[int, float] = {}  # orphan pid -> when SIGKILL is due
        self._spared: set[int] = set()  # detached on purpose
        self.enabled = become_subreaper()

    def reap(self) -> list[tuple[int, int]]:
        """Collect every ended child; the ranks among them as (pid, exit code)."""
        ended = []
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            self._doomed.pop(pid, None)
            self._spared.discard(pid)
            if pid in self.ranks:
                self.ranks.discard(pid)
                ended.append((pid, os.waitstatus_to_exitcode(status)))
        return ended

    def end_orphans(self) -> None:
        """SIGTERM new orphans of ended ranks; SIGKILL those past their grace."""
        if not self.enabled:
            return
        now = time.monotonic()
        for pid in _children() - self.ranks - self._spared:
            if pid in self._doomed:
                if now >= self._doomed[pid]:
                    _signal(pid, signal.SIGKILL)
                continue
            if _detached(pid):
                self._spared.add(pid)
                continue
            _signal(pid, signal.SIGTERM)
            self._doomed[pid] = now + KILL_AFTER

    def next_due(self) -> float | None:
        """Seconds until an orphan's SIGKILL is due (None: nothing pending)."""
        if not self._doomed:
            return None
        return max(0.0, min(self._doomed.values()) - time.monotonic())

    def kill_all(self, wait: float = 0.5) -> None:
        """The server is stopping: every rank and every orphan ends now (the orphans that the
        killed ranks leave behind included, for up to ``wait`` seconds)."""
        deadline = time.monotonic() + wait
        while True:
            left = _children() - self._spared if self.enabled else set(self.ranks)
            if not left or time.monotonic() > deadline:
                return
            for pid in left:
                _signal(pid, signal.SIGKILL)
            time.sleep(0.005)
            self.reap()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
