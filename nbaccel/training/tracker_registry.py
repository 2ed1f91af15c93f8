"""Accelerate's tracker registry names over nbaccel's registry (:mod:`nbaccel.training.trackers`):
``LOGGER_TYPE_TO_CLASS`` (a live name -> class view), ``register_tracker_class``,
``get_available_trackers`` and the ``on_main_process`` method decorator."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from nbaccel.distributed.state import PartialState
from nbaccel.training import trackers

__all__ = [
    "LOGGER_TYPE_TO_CLASS",
    "get_available_trackers",
    "on_main_process",
    "register_tracker_class",
]


class _TrackerClasses(Mapping):
    """Name -> tracker class of every registered tracker, read from the registry each time."""

    def _registry(self) -> Mapping[str, Any]:
        return trackers._REGISTRY

    def __getitem__(self, name: str) -> type:
        return self._registry()[name][0]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._registry()))

    def __len__(self) -> int:
        return len(self._registry())

    def __repr__(self) -> str:
        return repr(dict(self))


LOGGER_TYPE_TO_CLASS: Mapping[str, type] = _TrackerClasses()


def register_tracker_class(tracker_cls: type) -> type:
    """Register a ``GeneralTracker`` subclass under its ``name`` so ``log_with=name`` builds it;
    usable as a class decorator. A name already taken by another class is an error."""
    name = getattr(tracker_cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{tracker_cls.__name__} needs a class attribute `name` (a string).")
    taken = trackers._REGISTRY.get(name)
    if taken is not None and taken[0] is not tracker_cls:
        raise ValueError(f"Tracker name {name!r} is already registered by {taken[0].__name__}.")
    trackers.register_tracker(name, tracker_cls)
    return tracker_cls


def get_available_trackers() -> list[str]:
    """Names of the trackers that can run here."""
    return trackers.available_trackers()


def on_main_process(function: Callable[..., Any]) -> Callable[..., Any]:
    """Run a tracker method on the main process only (when the tracker's
    ``main_process_only`` is True); elsewhere the call returns None."""

    @functools.wraps(function)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "main_process_only", False) and not PartialState().is_main_process:
            return None
        return function(self, *args, **kwargs)

    return wrapper
