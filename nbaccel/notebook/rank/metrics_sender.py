"""Worker side: logged scalars travel to the notebook's metrics plot as batched events.

Both the notebook tracker (``Accelerator(log_with="notebook")``) and the Trainer's metrics
callback send through a :class:`MetricsSender`: points gather on the rank and leave as one
``metrics`` event at most every ``interval`` seconds; ``flush(final=True)`` sends the rest and
tells the renderer the run's plot is complete.
"""

from __future__ import annotations

import time
from typing import Any

from nbaccel.launch.rank.worker import emit
from nbaccel.notebook.events import METRICS, MetricsUpdate

__all__ = ["MetricsSender", "scalars"]


def scalars(values: dict[str, Any]) -> dict[str, float]:
    """The plottable values of a log: numbers and 0-d tensors, as floats (booleans and the
    rest left out)."""
    out = {}
    for key, value in values.items():
        if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
            value = value.item()
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = float(value)
    return out


class MetricsSender:
    """The points of one run (plot) logged on this rank, on their way to the notebook."""

    def __init__(self, run: str, interval: float = 1.0) -> None:
        self.run = run
        self.interval = interval
        self._pending: list[tuple[float, dict[str, float]]] = []
        self._sent_at = 0.0

    def add(self, step: float, values: dict[str, float]) -> None:
        """Queue one point; send the queue if ``interval`` has passed since the last send."""
        self._pending.append((float(step), values))
        if time.monotonic() - self._sent_at >= self.interval:
            self.flush()

    def flush(self, final: bool = False) -> None:
        """Send what is queued (with ``final``: even nothing, to close the run's plot)."""
        if self._pending or final:
            emit(METRICS, MetricsUpdate(self.run, self._pending, final))
        self._pending = []
        self._sent_at = time.monotonic()
