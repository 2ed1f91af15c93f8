"""Which renderer a launch uses in this process, and the widget renderer itself.

:func:`choose_renderer` returns a :class:`WidgetRenderer` inside a Jupyter kernel with
ipywidgets (also under nbclient/nbconvert, where the widget state can be stored in the executed
notebook), and the plain :class:`~nbaccel.launch.driver.renderer.TextRenderer` elsewhere.
``NBACCEL_RENDERER=text`` or ``=widgets`` forces the choice.

The widget renderer keeps a text twin of everything: rank-labelled lines and the announcement
are printed as text exactly like the text renderer (up to the group's output limit,
``nbaccel.launch.driver.output_budget``; the per-rank panel keeps a bounded tail of all of
them, those beyond the limit included), and the end of a launch displays a static
summary (final progress, peak memory per rank) as HTML and plain text. The few most recent
views stay interactive; older ones become static snapshots and close their widgets
(``nbaccel.notebook.kernel.widgets.view_lifetime``).
"""

from __future__ import annotations

import html
import os
import time
from typing import Any

from nbaccel.launch.driver.renderer import Renderer, TextRenderer
from nbaccel.launch.wire.labels import RankLabels
from nbaccel.launch.wire.protocol import EventKind, Stream
from nbaccel.notebook.events import MEMORY, METRICS, PROGRESS
from nbaccel.notebook.kernel.widgets import view_lifetime as lifetime

__all__ = ["WidgetRenderer", "choose_renderer", "widgets_available"]

_STATUS_INTERVAL = 1.0
_PANEL_LINE_CHARS = 2000  # of one line, in the per-rank panel


def widgets_available() -> bool:
    """True in a Jupyter kernel (a frontend may render widgets) with ipywidgets importable."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        return False
    if shell is None or getattr(shell, "kernel", None) is None:
        return False
    if type(shell).__name__ != "ZMQInteractiveShell":
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def choose_renderer() -> Renderer:
    """The renderer for a launch from this process (see the module docstring)."""
    forced = os.environ.get("NBACCEL_RENDERER", "").lower()
    if forced == "text":
        return TextRenderer()
    if forced in ("widget", "widgets") or widgets_available():
        return WidgetRenderer()
    return TextRenderer()


class WidgetRenderer(Renderer):
    """Progress bars, memory monitor and per-rank output panel for one launch."""

    def __init__(self) -> None:
        self.text = TextRenderer()
        self.root: Any = None
        self._handle: Any = None
        self._owned: set[str] = set()  # model ids of the widgets this view made

    def use_labels(self, labels: RankLabels) -> None:
        self.labels = labels
        self.text.use_labels(labels)

    # ------------------------------------------------------------------ lifecycle
    def start(self, announcement: str, num_processes: int) -> None:
        import ipywidgets as widgets
        from IPython.display import display

        from nbaccel.notebook.kernel.widgets.memory_monitor import MemoryMonitor
        from nbaccel.notebook.kernel.widgets.output_panel import OutputPanel
        from nbaccel.notebook.kernel.widgets.progress import ProgressBoard

        self.text.start(announcement, num_processes)
        self._before = lifetime.widget_ids()
        self.announcement = announcement
        self.num_processes = num_processes
        self.started = time.monotonic()
        self._status_at = 0.0
        self.status = widgets.HTML()
        self.status.add_class("nbaccel-status")
        self.progress = ProgressBoard(label=self.rank_label)
        self.memory = MemoryMonitor()
        self.outputs = OutputPanel(label=self.rank_label)
        self._parts = {"progress": False, "memory": False, "outputs": False}
        self.metrics: dict[str, Any] = {}
        self.root = widgets.VBox([self.status])
        self.root.add_class("nbaccel-launch")
        self._set_status("running")
        bundle = self.root._repr_mimebundle_()
        bundle["text/plain"] = f"nbaccel: {announcement} (live view: progress, memory, output)"
        self._handle = display(bundle, raw=True, display_id=True)

    def finish(self, ok: bool, failed: list[int] | None = None) -> None:
        if self.root is None:
            return
        from IPython.display import display

        self.progress.finish(ok)
        self.outputs.flush(force=True)
        elapsed = time.monotonic() - self.started
        self._set_status(f"{'finished' if ok else 'failed'} after {elapsed:.1f} s", ok)
        text, rich = self.summary(ok, elapsed, failed)
        if text:
            display({"text/plain": text, "text/html": rich}, raw=True)
        if self.metrics:  # live plots become static images with their last values as text
            self._attach(live=False)
            for plot in self.metrics.values():
                display(plot.bundle(), raw=True)
        self._owned = lifetime.widget_ids() - self._before
        lifetime.finished(self)

    def freeze(self) -> None:
        """Replace the live view by a static snapshot (status and the output panel's last
        lines, as HTML and text) and close every widget it made: an old launch costs the
        kernel no widgets."""
        if self.root is None:
            return
        status = self.status.value
        tail_html, tail_text = self.outputs.snapshot()
        plain = f"nbaccel: {self.num_processes} ranks · {self.state}"
        if tail_text:
            plain += "\n" + tail_text
        bundle = {
            "text/plain": plain,
            "text/html": f'<div class="nbaccel-launch nbaccel-frozen">{status}{tail_html}</div>',
        }
        if self._handle is not None:
            self._handle.update(bundle, raw=True)
        lifetime.close_widgets(self._owned | {self.root.model_id})
        self._owned = set()
        self.root = self.status = self.progress = self.memory = self.outputs = None
        self.metrics = {}

    def summary(self, ok: bool, elapsed: float, failed: list[int] | None = None) -> tuple[str, str]:
        """The launch's end as (plain text, HTML): final bars and peak memory per rank."""
        bars = self.progress.summary_lines()
        memory_text = self.memory.summary_text()
        if not bars and not memory_text:
            return "", ""
        head = f"nbaccel: {_outcome(self.num_processes, ok, failed)} in {elapsed:.1f} s"
        text = "\n".join([head, *bars, *([memory_text] if memory_text else [])])
        bar_html = "".join(f"<div>{html.escape(b)}</div>" for b in bars)
        rich = (
            f'<div class="nbaccel-summary"><b>{html.escape(head)}</b>'
            f'<pre style="margin:2px 0">{bar_html}</pre>{self.memory.summary_html()}</div>'
        )
        return text, rich

    # ------------------------------------------------------------------ events
    def line(self, rank: int, stream: Stream, text: str) -> None:
        self.text.line(rank, stream, text)
        self.overflow(rank, stream, text)

    def overflow(self, rank: int, stream: Stream, text: str) -> None:
        # beyond the output limit, the 'Output by rank' panel still shows each rank's tail
        self._attach("outputs")
        self.outputs.add(rank, stream, text[:_PANEL_LINE_CHARS])
        self._tick()

    def event(self, rank: int, kind: EventKind, payload: Any) -> None:
        if kind == PROGRESS:
            self._attach("progress")
            self.progress.update(rank, payload)
        elif kind == MEMORY:
            self._attach("memory")
            self.memory.update(rank, payload)
        elif kind == METRICS:
            self._metrics_update(payload)
        else:
            self.text.event(rank, kind, payload)
        self._tick()

    def _metrics_update(self, update: Any) -> None:
        from nbaccel.notebook.kernel.widgets.metrics import MetricsPlot

        plot = self.metrics.get(update.run)
        if plot is None:
            plot = self.metrics[update.run] = MetricsPlot(update.run)
            plot.make_widget()
            self._attach()
        for step, values in update.points:
            plot.add(values, step)
        plot.refresh(force=update.final)

    def notice(self, text: str) -> None:
        self.text.notice(text)

    # ------------------------------------------------------------------ helpers
    def _attach(self, part: str | None = None, live: bool = True) -> None:
        """(Re)build the view: status, then the parts that received something."""
        if part is not None:
            if self._parts[part]:
                return
            self._parts[part] = True
        boxes = {"progress": self.progress, "memory": self.memory, "outputs": self.outputs}
        shown = [boxes[name].box for name in ("progress", "memory") if self._parts[name]]
        plots = [plot.widget for plot in self.metrics.values()] if live else []
        outputs = [self.outputs.box] if self._parts["outputs"] else []
        self.root.children = (self.status, *shown, *plots, *outputs)

    def _tick(self) -> None:
        self.outputs.flush()
        now = time.monotonic()
        if now - self._status_at >= _STATUS_INTERVAL:
            self._set_status(f"running · {now - self.started:.0f} s")

    def _set_status(self, state: str, ok: bool | None = None) -> None:
        self._status_at = time.monotonic()
        self.state = state
        colour = {None: "#555", True: "#1e8449", False: "#c0392b"}[ok]
        self.status.value = (
            f'<span style="color:{colour}"><b>nbaccel</b> · {self.num_processes} ranks · '
            f"{html.escape(state)}</span>"
        )


def _outcome(num_processes: int, ok: bool, failed: list[int] | None) -> str:
    """``2 ranks finished``, ``1 rank failed (1 stopped)``, ``2 ranks stopped``."""
    if ok or failed is None:
        return f"{num_processes} ranks {'finished' if ok else 'failed'}"
    if not failed:  # nobody's own failure: the stop button, or the timeout
        return f"{num_processes} ranks stopped"
    text = f"{len(failed)} rank{'s' if len(failed) > 1 else ''} failed"
    others = num_processes - len(failed)
    return text + (f" ({others} stopped)" if others > 0 else "")
