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
from nbaccel.launch.wire.exception_state import copy_as, exception_instance, slot_fields

__all__ = ["as_child_failed"]


def _rebuild(original: type, args: tuple, fields: dict[str, Any], state: dict[str, Any]) -> Any:
    return exception_instance(_mixed_class(original), args, fields, state)


def _str(self: BaseException) -> str:
    # the rank's message (with its rank label), not torch elastic's table
    return shown_message(self, self._nbaccel_original_class.__str__)


def _reduce(self: BaseException) -> tuple[Any, ...]:
    fields = slot_fields(self)
    return _rebuild, (self._nbaccel_original_class, self.args, fields, dict(vars(self)))


@functools.cache
def _mixed_class(original: type) -> type:
    """The subclass of ``original`` and ChildFailedError, made once per class."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    namespace = {
        "__module__": original.__module__,
        "__qualname__": original.__qualname__,
        "__doc__": original.__doc__,
        "__reduce__": _reduce,
        "__reduce_ex__": lambda self, protocol: _reduce(self),
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
        exc = copy_as(exc, _mixed_class(original))
    except TypeError:  # a built-in layout that cannot take a Python subclass mixed in
        return exc
    failure = ProcessFailure(local_rank=rank, pid=-1, exitcode=1, error_file="")
    failure.message = f"{original.__name__}: {exc}"
    failure.timestamp = int(time.time())
    exc.name = name  # type: ignore[attr-defined]
    exc.failures = {rank: failure}  # type: ignore[attr-defined]
    return exc
