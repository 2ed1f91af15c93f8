"""A live plot of logged metrics (one panel per metric), redrawn at most every ``interval`` s.

Used by the notebook tracker (``Accelerator(log_with="notebook")``) directly in the kernel, and
by the launch renderer for ``metrics`` events sent by a tracker running on a rank. The plot is a
matplotlib PNG in an ``ipywidgets.Image``; :meth:`MetricsPlot.bundle` is its static twin (PNG +
text of the last values) for saved notebooks and logs.
"""

from __future__ import annotations

import base64
import io
import math
import time
from typing import Any

__all__ = ["MetricsPlot"]


class MetricsPlot:
    """History of scalar metrics and its rendering."""

    def __init__(self, title: str = "metrics", interval: float = 1.0, max_panels: int = 6) -> None:
        self.title = title
        self.interval = interval
        self.max_panels = max_panels
        self.history: dict[str, list[tuple[float, float]]] = {}
        self._drawn_at = 0.0
        self._dirty = False
        self.widget: Any = None

    def add(self, values: dict[str, float], step: float) -> None:
        for key, value in values.items():
            self.history.setdefault(key, []).append((step, float(value)))
        self._dirty = True

    def png(self) -> bytes:
        """The current plot as PNG bytes (matplotlib, no pyplot state touched)."""
        from matplotlib.figure import Figure

        keys = list(self.history)[: self.max_panels]
        cols = min(3, max(1, len(keys)))
        rows = math.ceil(len(keys) / cols) or 1
        fig = Figure(figsize=(3.3 * cols, 2.3 * rows), dpi=90)
        for i, key in enumerate(keys):
            ax = fig.add_subplot(rows, cols, i + 1)
            steps, values = zip(*self.history[key])
            ax.plot(steps, values, color="#2e86c1", lw=1.4)
            ax.set_title(f"{key}: {values[-1]:.4g}", fontsize=9)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        fig.suptitle(self.title, fontsize=10)
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        return buffer.getvalue()

    def make_widget(self) -> Any:
        import ipywidgets as widgets

        self.widget = widgets.Image(format="png", layout=widgets.Layout(max_width="100%"))
        self.widget.add_class("nbaccel-metrics")
        return self.widget

    def refresh(self, force: bool = False) -> None:
        """Redraw the widget if there is news and ``interval`` has passed (or ``force``)."""
        now = time.monotonic()
        if self.widget is None or not self._dirty or not self.history:
            return
        if not force and now - self._drawn_at < self.interval:
            return
        self._drawn_at, self._dirty = now, False
        self.widget.value = self.png()

    def text(self) -> str:
        last = ", ".join(f"{k}={v[-1][1]:.4g}" for k, v in self.history.items())
        steps = max((len(v) for v in self.history.values()), default=0)
        return f"{self.title}: {steps} logged steps; last: {last}"

    def bundle(self) -> dict[str, str]:
        """The static twin: PNG and plain text."""
        return {"image/png": base64.b64encode(self.png()).decode(), "text/plain": self.text()}
