"""Small companions of :mod:`nbaccel.distributed.state`: has the state been created, a
per-thread shared dict, and a do-nothing callable for ranks that skip a step."""

from __future__ import annotations

import threading
from typing import Any

from nbaccel.distributed.state import PartialState

__all__ = ["ThreadLocalSharedDict", "do_nothing", "is_initialized"]


def is_initialized() -> bool:
    """True once ``PartialState()`` (or ``Accelerator()``) has set up this process."""
    return bool(PartialState._shared_state)


def do_nothing(*args: Any, **kwargs: Any) -> None:
    """Accepts anything, returns None."""
    return None


class ThreadLocalSharedDict(threading.local):
    """A dict usable as a Borg ``_shared_state`` that can be made per-thread (``thread_local``)
    -- what several model replicas in one process (XLA's threads) need."""

    def __init__(self, thread_local: bool = False) -> None:
        self._storage: dict[str, Any] = {}

    def __get__(self, obj: Any, objtype: Any = None) -> dict[str, Any]:
        return self._storage

    def __set__(self, obj: Any, value: dict[str, Any]) -> None:
        self._storage = value
