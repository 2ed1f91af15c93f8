"""The fork server steps aside: its imports wait while ranks forked from the kernel start.

A one-shot launch that finds the server still importing the kernel's libraries forks its ranks
from the kernel itself (see ``forkserver``); the server's imports would take a core from them
on a small machine. The driver sends ``HOLD_SIGNAL``: each import of the server then waits before
it starts (at the next module, torch's own submodules included) until ``RELEASE_SIGNAL``, at most
``HOLD_AT_MOST`` seconds, and never once the process that started the server is gone (a held
server never outlives its kernel).

Standard library only: the server's bootstrap loads this file by its path and installs the hold
before anything imports torch (``import nbaccel`` does).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

__all__ = [
    "HOLD_AT_MOST",
    "HOLD_SIGNAL",
    "MODULE",
    "RELEASE_SIGNAL",
    "hold_signals_blocked",
    "install",
    "remove",
]

#: the name the bootstrap registers this file under, before ``nbaccel`` is importable
MODULE = __name__

#: real-time signals (user code and schedulers use SIGUSR1/SIGUSR2); None where the platform
#: has none: no holding there
HOLD_SIGNAL: int | None = (
    int(signal.SIGRTMIN) + 7 if hasattr(signal, "SIGRTMIN") else None  # type: ignore[attr-defined]
)
RELEASE_SIGNAL: int | None = None if HOLD_SIGNAL is None else HOLD_SIGNAL + 1
#: the longest the server's imports wait on one hold: a long run forked from the kernel must
#: not leave the next launch without a server
HOLD_AT_MOST = 30.0

_SIGNALS = [n for n in (HOLD_SIGNAL, RELEASE_SIGNAL) if n is not None]


@contextlib.contextmanager
def hold_signals_blocked() -> Iterator[None]:
    """Block the hold signals in this thread while it starts a server: the new process inherits
    the block, so a hold sent before the server handles it waits for it (their default action
    would end the process); :func:`install` lifts it once they are handled."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS) if _SIGNALS else None
    try:
        yield
    finally:
        if previous is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _Hold:
    """A ``sys.meta_path`` entry that finds nothing: while held, an import waits here first."""

    def __init__(self) -> None:
        self.owner = os.getppid()  # the kernel (or agent) that started the server
        self.held_since: float | None = None

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        while (
            self.held_since is not None
            and time.monotonic() - self.held_since < HOLD_AT_MOST
            and os.getppid() == self.owner
        ):
            time.sleep(0.02)
        self.held_since = None
        return None

    def invalidate_caches(self) -> None:
        """Nothing cached (``importlib.invalidate_caches`` calls every finder)."""

    def hold(self, *_: Any) -> None:
        self.held_since = time.monotonic()

    def release(self, *_: Any) -> None:
        self.held_since = None


def install() -> None:
    """Make this process (a fork server) obey the hold signals; once."""
    if not _SIGNALS or any(isinstance(finder, _Hold) for finder in sys.meta_path):
        return
    hold = _Hold()
    signal.signal(HOLD_SIGNAL, hold.hold)
    signal.signal(RELEASE_SIGNAL, hold.release)
    sys.meta_path.insert(0, hold)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)  # a hold already sent arrives now


def remove() -> None:
    """In a rank forked from the server: no hold, the signals back to their defaults."""
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _Hold)]
    for number in _SIGNALS:
        signal.signal(number, signal.SIG_DFL)
