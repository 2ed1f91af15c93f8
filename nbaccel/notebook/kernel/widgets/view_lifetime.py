"""How long a launch's live view keeps its widgets: the few most recent stay interactive, older
ones become a static snapshot and release every widget they made.

Each live view costs the kernel a dozen or more widget models (each with a comm, a layout and
a style) and the text its panels hold. A kernel that launches hundreds of times must not keep
them all: when a view finishes it joins a short queue of interactive views
(``NBACCEL_LIVE_VIEWS``, default 3); the view pushed out of the queue replaces its output with a
static HTML/text snapshot of what it showed (status, last lines of the output panel) and closes
its widgets.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from typing import Any, Protocol

__all__ = ["LIVE_VIEWS_VAR", "FreezableView", "finished", "live_views", "widget_ids"]

LIVE_VIEWS_VAR = "NBACCEL_LIVE_VIEWS"
_DEFAULT_LIVE = 3


class FreezableView(Protocol):
    def freeze(self) -> None:
        """Replace the live view by its static snapshot and close its widgets."""


class _LiveViews:
    """The finished views of this kernel still interactive, oldest first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._views: deque[FreezableView] = deque()

    def add(self, view: FreezableView, limit: int) -> list[FreezableView]:
        """Keep ``view``; the views pushed past ``limit`` (to freeze)."""
        with self._lock:
            self._views.append(view)
            return [self._views.popleft() for _ in range(len(self._views) - limit)]

    def __len__(self) -> int:
        return len(self._views)


_live = _LiveViews()


def _limit() -> int:
    try:
        return max(0, int(os.environ.get(LIVE_VIEWS_VAR, _DEFAULT_LIVE)))
    except ValueError:
        return _DEFAULT_LIVE


def widget_ids() -> set[str]:
    """The model ids of every widget open in this kernel."""
    from ipywidgets.widgets import widget

    return set(widget._instances)


def close_widgets(ids: set[str]) -> None:
    """Close the widgets with these model ids (those still open)."""
    from ipywidgets.widgets import widget

    for model_id in ids:
        found: Any = widget._instances.get(model_id)
        if found is not None:
            found.close()


def finished(view: FreezableView) -> None:
    """``view`` has finished: keep it interactive for now, freeze the ones past the limit."""
    for old in _live.add(view, _limit()):
        old.freeze()


def live_views() -> int:
    """How many finished views are still interactive."""
    return len(_live)
