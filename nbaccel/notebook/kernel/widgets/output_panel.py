"""Per-rank output panel: a tab per rank plus a merged view, each a bounded, scrolling tail.

Only the last ``max_lines`` lines of each view are kept and sent to the frontend, so a rank that
prints a million lines costs a bounded DOM, not megabytes. Widget updates are coalesced: the
panel is redrawn at most every ``interval`` seconds (and once more at the end).
"""

from __future__ import annotations

import html
import re
import time
from collections import deque
from collections.abc import Callable

import ipywidgets as widgets

from nbaccel.launch.wire.labels import LOCAL_LABELS
from nbaccel.launch.wire.protocol import Stream

__all__ = ["OutputPanel"]

_PANE = widgets.Layout(max_height="260px", overflow="auto", width="100%")
_STDERR = '<span style="color:#c0392b">{}</span>'


class _Pane:
    def __init__(self, max_lines: int) -> None:
        self.lines: deque[str] = deque(maxlen=max_lines)
        self.total = 0
        self.widget = widgets.HTML(layout=_PANE)
        self.widget.add_class("nbaccel-log")
        self.dirty = False

    def add(self, rendered: str) -> None:
        self.lines.append(rendered)
        self.total += 1
        self.dirty = True

    def render(self) -> None:
        dropped = self.total - len(self.lines)
        head = f"<i>... {dropped} earlier lines not kept ...</i>\n" if dropped else ""
        body = "\n".join(self.lines)
        self.widget.value = f'<pre style="margin:0;font-size:12px">{head}{body}</pre>'
        self.dirty = False


class OutputPanel:
    """Tabs ``all | rank 0 | rank 1 | ...`` inside a collapsed accordion."""

    def __init__(
        self,
        max_lines: int = 500,
        interval: float = 0.25,
        label: Callable[[int], str] = LOCAL_LABELS.label,
    ) -> None:
        self.label = label  # how the merged view names a rank (its renderer's labels)
        self.max_lines = max_lines
        self.interval = interval
        self._merged = _Pane(2 * max_lines)
        self._ranks: dict[int, _Pane] = {}
        self.tabs = widgets.Tab(children=(self._merged.widget,), titles=("all ranks",))
        self.box = widgets.Accordion(children=(self.tabs,), titles=("Output by rank",))
        self.box.selected_index = None
        self.box.add_class("nbaccel-outputs")
        self._last_flush = 0.0

    def add(self, rank: int, stream: str, text: str) -> None:
        pane = self._ranks.get(rank)
        if pane is None:
            pane = self._ranks[rank] = _Pane(self.max_lines)
            ranks = sorted(self._ranks)
            self.tabs.children = (self._merged.widget, *(self._ranks[r].widget for r in ranks))
            self.tabs.titles = ("all ranks", *(f"rank {r}" for r in ranks))
        line = html.escape(text)
        if stream == Stream.STDERR:
            line = _STDERR.format(line)
        pane.add(line)
        self._merged.add(f"<b>[{html.escape(self.label(rank))}]</b> {line}")

    def flush(self, force: bool = False) -> None:
        """Redraw the views that changed, unless the last redraw was under ``interval`` ago."""
        now = time.monotonic()
        if not force and now - self._last_flush < self.interval:
            return
        self._last_flush = now
        for pane in (self._merged, *self._ranks.values()):
            if pane.dirty:
                pane.render()

    @property
    def lines(self) -> int:
        return self._merged.total

    def snapshot(self, max_lines: int = 40) -> tuple[str, str]:
        """The last ``max_lines`` of the merged pane as (HTML, text), for a frozen view."""
        if not self._merged.total:
            return "", ""
        kept = list(self._merged.lines)[-max_lines:]
        earlier = self._merged.total - len(kept)
        head = f"<i>... {earlier} earlier lines ...</i>\n" if earlier else ""
        body = "\n".join(kept)
        rich = (
            "<details><summary>Output by rank (last lines)</summary>"
            f'<pre style="margin:0;font-size:12px">{head}{body}</pre></details>'
        )
        text = "\n".join(html.unescape(re.sub(r"<[^>]+>", "", line)) for line in kept)
        return rich, text
