"""Send a display bundle from a pool worker to the notebook, in order with the rank's output.

Both the cell runner (``display()``, rich last-expression values) and the matplotlib backend
(figures) publish through here.
"""

from __future__ import annotations

from typing import Any

from nbaccel.launch.rank.worker import emit, flush_output
from nbaccel.launch.wire.protocol import EventKind

__all__ = ["publish"]


def publish(data: dict[str, Any], metadata: dict[str, Any] | None = None) -> None:
    """Send one display bundle to the notebook, after the output printed before it."""
    flush_output()
    emit(EventKind.DISPLAY, {"data": data, "metadata": metadata or {}})
