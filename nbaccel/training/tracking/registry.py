"""Accelerate's tracker helpers over nbaccel's registry (:mod:`nbaccel.training.tracking.trackers`):
``get_available_trackers`` and the ``on_main_process`` method decorator."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from nbaccel.distributed.state import PartialState
from nbaccel.training.tracking import trackers

__all__ = ["get_available_trackers", "on_main_process"]


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
