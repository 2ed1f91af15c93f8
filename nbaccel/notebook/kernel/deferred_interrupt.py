"""Turn the stop button into a flag while the driver waits on its ranks.

A ``KeyboardInterrupt`` raised halfway through reading a message from a rank would leave that
stream out of step. While a :class:`DeferredInterrupt` is active, SIGINT only counts; the waiting
loop checks ``count`` between selector rounds (at most 0.2 s apart) and stops the cell cleanly.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

try:  # the C function behind ``signal.signal``, whose wrapper converts the handler it returns
    # to the ``Handlers`` enum, raising and catching a ValueError for a Python handler (~60 µs
    # per cell on a cold core)
    from _signal import signal as _set_handler
except ImportError:  # another Python implementation
    _set_handler = signal.signal

__all__ = ["DeferredInterrupt"]


class DeferredInterrupt:
    """Context manager: count SIGINTs instead of raising (main thread only; else a no-op)."""

    def __init__(self) -> None:
        self.count = 0
        self._installed = False
        self._previous: Any = None

    def _handler(self, signum: int, frame: Any) -> None:
        self.count += 1

    def __enter__(self) -> DeferredInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = _set_handler(signal.SIGINT.value, self._handler)
            self._installed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._installed:
            previous = self._previous
            _set_handler(
                signal.SIGINT.value, signal.default_int_handler if previous is None else previous
            )
