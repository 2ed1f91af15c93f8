"""``Accelerator(log_with="notebook")``: metrics plotted live in the notebook.

In the kernel itself the tracker draws a
:class:`~nbaccel.notebook.kernel.widgets.metrics.MetricsPlot`
under the cell. On a rank started by ``notebook_launcher`` or ``%%distributed`` (where trackers
usually run) it sends ``metrics`` events, batched at most every ``interval`` seconds, and the
launch's widget renderer plots them. ``finish()`` leaves a static plot and the last values as
text in the notebook (the live widget is replaced by them).

Importing this module registers the tracker; ``nbaccel/__init__.py`` does, so
``log_with="notebook"`` works wherever nbaccel is imported.
"""

from __future__ import annotations

from typing import Any

from nbaccel.launch.rank.worker import on_worker
from nbaccel.notebook.rank.metrics_sender import MetricsSender, scalars
from nbaccel.training.tracking.registry import register_tracker_class
from nbaccel.training.tracking.trackers import GeneralTracker

__all__ = ["NotebookTracker"]


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


class NotebookTracker(GeneralTracker):
    """Live plots of the scalars passed to ``accelerator.log`` (non-scalars are ignored)."""

    name = "notebook"
    requires_logging_directory = False

    def __init__(self, run_name: str = "run", interval: float = 1.0, **kwargs: Any) -> None:
        super().__init__(run_name)
        self.interval = interval
        self._steps = 0
        self._sender = MetricsSender(run_name, interval) if on_worker() else None
        self.plot = None
        self._handle = None
        if self._sender is None:
            from nbaccel.notebook.kernel.widgets.metrics import MetricsPlot

            self.plot = MetricsPlot(run_name, interval)

    @property
    def tracker(self) -> Any:
        return self.plot

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        numbers = scalars(values)
        if not numbers:
            return
        point = float(self._steps if step is None else step)
        self._steps += 1
        if self._sender is not None:
            self._sender.add(point, numbers)
            return
        self.plot.add(numbers, point)
        if self.plot.widget is None and _in_kernel():
            from IPython.display import display

            bundle = self.plot.make_widget()._repr_mimebundle_()
            bundle["text/plain"] = f"{self.run_name}: live metrics plot"
            self._handle = display(bundle, raw=True, display_id=True)
        self.plot.refresh()

    def finish(self) -> None:
        if self._sender is not None:
            self._sender.flush(final=True)
            return
        if self.plot is None or not self.plot.history:
            return
        if self._handle is not None:  # the live widget becomes a static plot + text
            self._handle.update(self.plot.bundle(), raw=True)
        elif _in_kernel():
            from IPython.display import display

            display(self.plot.bundle(), raw=True)
        else:
            print(self.plot.text())


register_tracker_class(NotebookTracker, name="notebook")
