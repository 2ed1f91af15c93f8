"""What cannot travel to the ranks (or back), named with its path and the fix.

``transport.pack`` raises :class:`UnpicklableError` built here: the first leaf that does not
pickle, found by walking containers, modules and attributes (``args[1]['lock']``), with where
it was going and what to do; or, for multiprocessing's queues, locks and events, which reach
other processes only by inheritance, the way to pass them that works.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import torch

from nbaccel.launch.wire.pickling import dumps

__all__ = [
    "InheritanceOnly",
    "ResultNotSendable",
    "UnpicklableError",
    "inheritance_only_refused",
    "inheritance_only_types",
    "unpicklable_refused",
]


class UnpicklableError(TypeError):
    """An object cannot be sent to the ranks (or a value back); the message names it, its path
    and the fix. ``where`` (the path), ``culprit`` (the type that does not pickle) and
    ``cause`` (pickle's error) are its parts, for a front that words it its own way."""

    where: str | None = None
    culprit: str | None = None
    cause: str | None = None


class ResultNotSendable(UnpicklableError):
    """A call succeeded on its rank, but the value it returned cannot be sent back."""

    #: how the worker names the value in ``where`` (``the return value['lock']``)
    value_name = "the return value"


#: multiprocessing's types that reach another process only by inheritance, by module
_INHERITANCE_ONLY = {
    "multiprocessing.queues": ("Queue", "SimpleQueue"),
    "multiprocessing.synchronize": ("SemLock", "Condition", "Event", "Barrier"),
    "multiprocessing.sharedctypes": ("SynchronizedBase",),
}


def inheritance_only_types() -> tuple[type, ...]:
    """multiprocessing's types that reach another process only by inheritance. Only modules
    already imported count (an instance cannot exist before its module is imported), so that
    packing a rank's result imports nothing."""
    return tuple(
        getattr(sys.modules[module], name)
        for module, names in _INHERITANCE_ONLY.items()
        if module in sys.modules
        for name in names
    )


class InheritanceOnly(Exception):
    """Raised by the pickler at an object that reaches other processes only by inheritance."""

    def __init__(self, obj: Any) -> None:
        super().__init__(type(obj).__name__)
        self.obj = obj


def _walk(obj: Any, path: str, depth: int = 0) -> Iterator[tuple[str, Any]]:
    """Yield (path, child) pairs to locate an unpicklable leaf."""
    if depth > 6:
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield f"{path}[{key!r}]", value
    elif isinstance(obj, list | tuple | set | frozenset):
        for index, value in enumerate(obj):
            yield f"{path}[{index}]", value
    elif isinstance(obj, torch.nn.Module):
        for name, value in vars(obj).items():
            if name in ("_parameters", "_buffers"):
                continue
            if name == "_modules":
                for child_name, child in value.items():
                    yield f"{path}.{child_name}", child
            elif not name.startswith("_"):
                yield f"{path}.{name}", value
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for name, value in vars(obj).items():
            yield f"{path}.{name}", value


def _find_unpicklable(obj: Any, path: str, depth: int = 0) -> tuple[str, Any, Exception] | None:
    try:
        dumps(obj)
        return None
    except Exception as exc:
        for child_path, child in _walk(obj, path, depth):
            found = _find_unpicklable(child, child_path, depth + 1)
            if found is not None:
                return found
        return path, obj, exc


def _find_inheritance_only(obj: Any, path: str, depth: int = 0) -> str | None:
    if isinstance(obj, inheritance_only_types()):
        return path
    for child_path, child in _walk(obj, path, depth):
        found = _find_inheritance_only(child, child_path, depth + 1)
        if found is not None:
            return found
    return None


def inheritance_only_refused(
    exc: InheritanceOnly, obj: Any, name: str, names: tuple[str, ...] | None
) -> UnpicklableError:
    """The error for ``obj`` holding an object multiprocessing shares only by inheritance
    (``exc`` from the pickler), naming where it sits and the fix."""
    where = None
    if names is not None:
        for item, item_name in zip(obj, names):
            where = where or _find_inheritance_only(item, item_name)
    where = where or _find_inheritance_only(obj, name) or name
    kind = type(exc.obj).__name__
    return UnpicklableError(
        f"{where} (a multiprocessing {kind}) reaches other processes only by inheritance, and "
        "these ranks are started from a fork server, not forked from this process. Launch with "
        f"start_method='fork' (the ranks inherit the {kind} as they would under Accelerate's "
        f"fork), or pass a manager proxy, which travels: multiprocessing.Manager().{kind}()."
    )


# Where a packed object goes, and what to do when it cannot: (destination, advice).
_TOWARD = {
    "ranks": (
        "the worker processes",
        "Create it inside the launched function instead, or pass something picklable (a path, "
        "a config, a state_dict).",
    ),
    "notebook": (
        "the notebook",
        "Return something picklable instead: numbers, tensors, lists, dicts, a state_dict "
        "(list(...) of a generator).",
    ),
}


def unpicklable_refused(
    exc: Exception, obj: Any, name: str, names: tuple[str, ...] | None, toward: str
) -> UnpicklableError:
    """The error for ``obj`` failing to pickle (``exc``): the first unpicklable leaf by its path
    (``names`` names the items of a top-level tuple), where it was going, and what to do."""
    found = None
    if names is not None:
        for item, item_name in zip(obj, names):
            found = found or _find_unpicklable(item, item_name)
    found = found or _find_unpicklable(obj, name)
    where, culprit, cause = found if found else (name, obj, exc)
    destination, advice = _TOWARD[toward]
    error = UnpicklableError(
        f"{where} ({type(culprit).__name__}) cannot be sent to {destination}: "
        f"{type(cause).__name__}: {cause}. {advice}"
    )
    error.where, error.culprit = where, type(culprit).__name__
    error.cause = f"{type(cause).__name__}: {cause}"
    return error
