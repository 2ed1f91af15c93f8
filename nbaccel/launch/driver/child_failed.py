"""A rank's error as both its own type and torch elastic's ``ChildFailedError``.

Accelerate's ``notebook_launcher`` runs ranks under torch elastic and raises
``torch.distributed.elastic.multiprocessing.errors.ChildFailedError`` when one fails; nbaccel
raises the rank's original exception. Code written for either catches it when the raised object
is an instance of both: its class becomes a subclass of the original class and of
``ChildFailedError`` (one per original class, made once), with the original message, attributes,
cause and traceback, ``name`` and ``failures`` as torch elastic fills them, and pickling that
rebuilds the same mixed class.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from nbaccel.launch.wire.errors import shown_message, unlabelled

__all__ = ["as_child_failed"]

_OS_FIELDS = ("errno", "strerror", "filename", "filename2")  # OSError's, outside args/__dict__


def _rebuild(original: type, args: tuple, state: dict[str, Any]) -> BaseException:
    mixed = _mixed_class(original)
    exc = mixed.__new__(mixed, *args)
    exc.args = args
    state = dict(state)
    for name, value in zip(_OS_FIELDS, state.pop("_nbaccel_os_fields", ())):
        setattr(exc, name, value)
    exc.__dict__.update(state)
    return exc


def _state(exc: BaseException) -> dict[str, Any]:
    state = dict(getattr(exc, "__dict__", {}))
    if isinstance(exc, OSError):
        state["_nbaccel_os_fields"] = tuple(getattr(exc, name) for name in _OS_FIELDS)
    return state


def _str(self: BaseException) -> str:
    # the rank's message (with its rank label), not torch elastic's table
    return shown_message(self, self._nbaccel_original_class.__str__)


def _reduce(self: BaseException) -> tuple[Any, ...]:
    return _rebuild, (self._nbaccel_original_class, self.args, _state(self))


@functools.cache
def _mixed_class(original: type) -> type:
    """The subclass of ``original`` and ChildFailedError, made once per class."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    namespace = {
        "__module__": original.__module__,
        "__qualname__": original.__qualname__,
        "__doc__": original.__doc__,
        "__reduce__": _reduce,
        "__str__": _str,
        "_nbaccel_original_class": original,
    }
    return type(original.__name__, (original, ChildFailedError), namespace)


def as_child_failed(exc: BaseException, name: str, rank: int | None = None) -> BaseException:
    """``exc`` (a failed rank's exception) made an instance of ``ChildFailedError`` too.

    ``name`` is the launched function's name (``ChildFailedError.name``); ``rank`` the failed
    rank (``failures`` key). Exceptions outside ``Exception`` (KeyboardInterrupt) and classes
    that cannot be extended are returned unchanged.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    if isinstance(exc, ChildFailedError) or not isinstance(exc, Exception):
        return exc
    rank = int(getattr(exc, "rank", 0) if rank is None else rank)
    original = unlabelled(type(exc))  # a rank-labelled copy stands for its plain class
    try:
        mixed = _rebuild(original, exc.args, _state(exc))
    except TypeError:  # a built-in layout that cannot take a Python subclass mixed in
        return exc
    mixed.__cause__, mixed.__context__ = exc.__cause__, exc.__context__
    mixed.__suppress_context__ = exc.__suppress_context__
    mixed.__traceback__ = exc.__traceback__
    exc = mixed
    failure = ProcessFailure(local_rank=rank, pid=-1, exitcode=1, error_file="")
    failure.message = f"{original.__name__}: {exc}"
    failure.timestamp = int(time.time())
    exc.name = name  # type: ignore[attr-defined]
    exc.failures = {rank: failure}  # type: ignore[attr-defined]
    return exc
