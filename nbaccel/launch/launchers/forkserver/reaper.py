"""Everything a rank starts ends with it: the fork server ends what a dead rank left.

A rank ends its own descendants when its work ends (``host.descendants``). A rank that dies by
a signal cannot: the fork server is a child subreaper too (``PR_SET_CHILD_SUBREAPER``), so
what such a rank started is re-parented to the server, which therefore knows that any child it
did not fork itself belongs to a rank that is gone, and ends it: SIGTERM, then SIGKILL after
:data:`KILL_AFTER` seconds.

A process meant to outlive its launch opts out: start it with ``NBACCEL_DETACH=1`` in the
environment it is *executed* with (``subprocess.Popen(cmd, env={**os.environ,
"NBACCEL_DETACH": "1"}, start_new_session=True)``); the server then leaves it alone. Elsewhere
than Linux (no subreapers) the driver's tree kill at stop time is all there is.
"""

from __future__ import annotations

import os
import signal
import time

from nbaccel.launch.host.descendants import (
    DETACH_ENV,
    KILL_AFTER,
    become_subreaper,
    children,
    detached,
)

__all__ = ["DETACH_ENV", "KILL_AFTER", "Reaper", "become_subreaper"]


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
        for pid in children() - self.ranks - self._spared:
            if pid in self._doomed:
                if now >= self._doomed[pid]:
                    _signal(pid, signal.SIGKILL)
                continue
            if detached(pid):
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
            left = children() - self._spared if self.enabled else set(self.ranks)
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
