"""How a ``%%distributed`` cell's output looks: rank-labelled lines, values and display bundles.

:class:`CellRenderer` is the renderer of one cell: lines go out as ``[rank N] ...`` text, progress
and memory events to the launch renderers (widgets in Jupyter); ``display`` bundles sent by a rank
(``display(...)``, matplotlib figures, rich last-expression values) are shown with
``IPython.display.display(raw=True)`` under the rank's label, unless the current renderer has a
``display(rank, data, metadata)`` method of its own (a widget renderer can put them in the rank's
pane).
"""

from __future__ import annotations

import html
import sys
from collections.abc import Callable
from typing import Any

from nbaccel.launch.driver.renderer import Renderer, TextRenderer
from nbaccel.launch.wire.labels import RankLabels
from nbaccel.launch.wire.protocol import EventKind, Stream
from nbaccel.notebook.kernel.widget_renderer import choose_renderer
from nbaccel.values.byte_text import human_bytes

__all__ = ["CellRenderer", "status_bundle"]


class CellRenderer(Renderer):
    """The renderer of one cell on the pool.

    Lines go to a :class:`TextRenderer` (``[rank N] ...``); the first progress (or other
    non-memory) event switches to the notebook's rich renderer (``choose_renderer()``: widgets in
    Jupyter, memory included from then on), so plain cells cost no widget and cells with progress
    bars get them.

    Args:
        on_info: called with ``(rank, payload)`` for the workers' ``pool_info`` events.
        quiet: hide stdout lines, display bundles and values (stderr and errors still show).
        rich: makes the rich renderer (default: ``choose_renderer``).
        inner: a renderer to use for everything instead (no switching).
    """

    def __init__(
        self,
        on_info: Callable[[int, dict[str, Any]], None] | None = None,
        quiet: bool = False,
        rich: Callable[[], Renderer] | None = None,
        inner: Renderer | None = None,
    ) -> None:
        self.inner: Renderer = inner or TextRenderer()
        self.on_info = on_info
        self.quiet = quiet
        self._rich = None if inner is not None else (rich or choose_renderer)
        self._started: tuple[str, int] = ("", 0)

    def use_labels(self, labels: RankLabels) -> None:
        self.labels = labels
        self.inner.use_labels(labels)

    def start(self, announcement: str, num_processes: int) -> None:
        self._started = ("" if self.quiet else announcement, num_processes)
        self.inner.start(*self._started)

    def line(self, rank: int, stream: Stream, text: str) -> None:
        if not (self.quiet and stream == Stream.STDOUT):
            self.inner.line(rank, stream, text)

    def overflow(self, rank: int, stream: Stream, text: str) -> None:
        if not (self.quiet and stream == Stream.STDOUT):
            self.inner.overflow(rank, stream, text)

    def notice(self, text: str) -> None:
        self.inner.notice(text)

    def finish(self, ok: bool, failed: list[int] | None = None) -> None:
        self.inner.finish(ok, failed)

    def _upgrade(self) -> None:
        factory, self._rich = self._rich, None
        if factory is None:
            return
        rich = factory()
        if not isinstance(rich, TextRenderer):
            rich.use_labels(self.labels)
            rich.start("", self._started[1])
            self.inner = rich

    def event(self, rank: int, kind: EventKind, payload: Any) -> None:
        if kind == EventKind.POOL_INFO:
            if self.on_info is not None:
                self.on_info(rank, payload)
        elif kind == EventKind.DISPLAY:
            self.show(rank, payload.get("data", {}), payload.get("metadata", {}))
        elif kind == EventKind.MEMORY and self._rich is not None:
            return  # memory alone does not bring up the live view (``%dist_status`` has it)
        else:
            self._upgrade()
            self.inner.event(rank, kind, payload)

    def show(self, rank: int, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        """Show one display bundle from ``rank``: text as labelled lines, rich data raw."""
        if self.quiet or not data:
            return
        own = getattr(self.inner, "display", None)
        if callable(own):
            own(rank, data, metadata)
            return
        if set(data) <= {"text/plain"}:
            for text in str(data.get("text/plain", "")).splitlines() or [""]:
                self.inner.line(rank, Stream.STDOUT, text)
            return
        try:
            from IPython import get_ipython
            from IPython.display import display
        except ImportError:  # pragma: no cover - IPython is a dependency
            get_ipython = None
        if get_ipython is None or get_ipython() is None:
            self.inner.line(rank, Stream.STDOUT, str(data.get("text/plain", sorted(data))))
            return
        sys.stdout.write(f"[{self.rank_label(rank)}]\n")
        sys.stdout.flush()
        display(data, metadata=metadata, raw=True)


_COLUMNS = ("rank", "pid", "device", "memory", "device memory", "state", "uptime", "names")


def _uptime(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def status_bundle(rows: list[dict[str, Any]], header: str) -> dict[str, str]:
    """A text and HTML table of the pool's ranks (rows from ``Pool.status()``)."""
    cells = [
        [
            str(row["rank"]),
            str(row.get("pid", "-")),
            str(row.get("device", "-")),
            human_bytes(row.get("rss")),
            human_bytes(row.get("device_memory")) if row.get("device_memory") is not None else "-",
            row.get("state", "-"),
            _uptime(row.get("uptime")),
            str(row.get("names", "-")),
        ]
        for row in rows
    ]
    problems = sorted({row["problem"] for row in rows if row.get("problem")})
    if problems:  # the ranks could not say more: why
        header = f"{header} (the ranks did not report their details: {'; '.join(problems)})"
    widths = [max(len(c[i]) for c in [list(_COLUMNS), *cells]) for i in range(len(_COLUMNS))]
    lines = [header, "  ".join(h.ljust(w) for h, w in zip(_COLUMNS, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths)) for cell in cells]
    head = "".join(f"<th>{html.escape(h)}</th>" for h in _COLUMNS)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cell) + "</tr>" for cell in cells
    )
    table = f"<p>{html.escape(header)}</p><table><tr>{head}</tr>{body}</table>"
    return {"text/plain": "\n".join(line.rstrip() for line in lines), "text/html": table}
