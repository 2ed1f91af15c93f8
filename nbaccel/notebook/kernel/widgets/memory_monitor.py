"""Live memory monitor: per rank, host RSS and device memory against capacity, with a timeline.

Fed by :class:`~nbaccel.notebook.events.MemorySample` events (about 2 per second per rank). At
the end of a launch :meth:`MemoryMonitor.summary_html` / :meth:`summary_text` give the peak per
rank as a static table that stays readable in a saved notebook.
"""

from __future__ import annotations

import html
from collections import deque
from dataclasses import dataclass, field

import ipywidgets as widgets

from nbaccel.notebook.events import MemorySample
from nbaccel.values.byte_text import human_bytes

__all__ = ["MemoryMonitor", "sparkline"]

_TIMELINE = 120  # samples kept for the timeline (a minute at 2 Hz)


def sparkline(values: list[float], width: int = 140, height: int = 26) -> str:
    """A tiny inline SVG polyline of ``values``, spread over the width, scaled to their range."""
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = (hi - lo) or max(abs(hi), 1.0)
    step = width / max(1, len(values) - 1)
    points = " ".join(
        f"{i * step:.1f},{height - 2 - (height - 4) * (v - lo) / span:.1f}"
        for i, v in enumerate(values)
    )
    return (
        f'<svg class="nbaccel-sparkline" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}"><title>{len(values)} samples, '
        f'{human_bytes(lo)} to {human_bytes(hi)}</title><polyline fill="none" stroke="#2e86c1" '
        f'stroke-width="1.5" points="{points}"/></svg>'
    )


def _nowrap(text: str) -> str:
    return f'<span style="white-space:nowrap">{html.escape(text)}</span>'


@dataclass
class _Peaks:
    rss: int = 0
    device: int = 0
    reserved: int = 0
    capacity: int | None = None
    kind: str | None = None
    timeline: deque = field(default_factory=lambda: deque(maxlen=_TIMELINE))


class _RankRow:
    def __init__(self, rank: int) -> None:
        self.label = widgets.HTML(f"<b>rank {rank}</b>", layout=widgets.Layout(width="5em"))
        self.host = widgets.FloatProgress(min=0.0, max=1.0, layout=widgets.Layout(width="10em"))
        self.host.add_class("nbaccel-host-bar")
        self.host_text = widgets.HTML(layout=widgets.Layout(width="17em"))
        hidden = widgets.Layout(width="10em", display="none")
        self.device = widgets.FloatProgress(min=0.0, max=1.0, layout=hidden)
        self.device.add_class("nbaccel-device-bar")
        self.device_text = widgets.HTML(layout=widgets.Layout(width="22em", display="none"))
        self.timeline = widgets.HTML(layout=widgets.Layout(width="150px"))
        self.box = widgets.HBox(
            [self.label, self.host, self.host_text, self.device, self.device_text, self.timeline]
        )
        self.box.add_class("nbaccel-memory-row")
        self.box.add_class(f"nbaccel-rank-{rank}")

    def show(self, s: MemorySample, p: _Peaks) -> None:
        with self.host.hold_sync():
            self.host.max = float(s.host_total)
            self.host.value = float(s.rss)
        self.host_text.value = _nowrap(f"RSS {human_bytes(s.rss)} · peak {human_bytes(p.rss)}")
        device = s.device_used()
        if device is not None:
            used, _peak, capacity = device
            if self.device.layout.display == "none":
                self.device.layout.display = self.device_text.layout.display = "flex"
            with self.device.hold_sync():
                self.device.max = float(capacity or max(used, 1))
                self.device.value = float(used)
            reserved = f" · reserved {human_bytes(p.reserved)}" if s.cuda else ""
            self.device_text.value = _nowrap(
                f"{p.kind} {human_bytes(used)} / {human_bytes(capacity)} · peak "
                f"{human_bytes(p.device)}{reserved}"
            )
        self.timeline.value = sparkline(list(p.timeline))


class MemoryMonitor:
    """One row per rank; created on the first sample, so ``memory=False`` shows nothing."""

    def __init__(self) -> None:
        self.title = widgets.HTML("<b>Memory</b> per rank: host RSS, accelerator memory, timeline")
        self.box = widgets.VBox([self.title])
        self.box.add_class("nbaccel-memory")
        self._rows: dict[int, _RankRow] = {}
        self.peaks: dict[int, _Peaks] = {}

    def update(self, rank: int, s: MemorySample) -> None:
        p = self.peaks.setdefault(rank, _Peaks())
        p.rss = max(p.rss, s.rss_peak, s.rss)
        device = s.device_used()
        if device is not None:
            used, peak, capacity = device
            p.device = max(p.device, used, peak or 0)
            p.capacity, p.kind = capacity, s.device_kind
            if s.cuda:
                p.reserved = max(p.reserved, s.cuda.get("peak_reserved") or s.cuda["reserved"])
            p.timeline.append(float(used))
        else:
            p.timeline.append(float(s.rss))
        row = self._rows.get(rank)
        if row is None:
            row = self._rows[rank] = _RankRow(rank)
            self.box.children = (self.title, *(self._rows[r].box for r in sorted(self._rows)))
        row.show(s, p)

    def summary_rows(self) -> list[tuple[int, str, str]]:
        """(rank, host peak, device peak) per rank."""
        rows = []
        for rank in sorted(self.peaks):
            p = self.peaks[rank]
            device = "-"
            if p.kind:
                device = f"{p.kind} {human_bytes(p.device)} of {human_bytes(p.capacity)}"
                if p.reserved:
                    device += f" (reserved {human_bytes(p.reserved)})"
            rows.append((rank, human_bytes(p.rss), device))
        return rows

    def summary_text(self) -> str:
        rows = self.summary_rows()
        if not rows:
            return ""
        parts = [
            f"rank {r}: host RSS {host}" + (f", device {dev}" if dev != "-" else "")
            for r, host, dev in rows
        ]
        return "Memory peak per rank: " + "; ".join(parts)

    def summary_html(self) -> str:
        rows = self.summary_rows()
        if not rows:
            return ""
        device = any(dev != "-" for _, _, dev in rows)
        body = "".join(
            f"<tr><td>rank {r}</td><td>{html.escape(host)}</td>"
            + (f"<td>{html.escape(dev)}</td>" if device else "")
            + "</tr>"
            for r, host, dev in rows
        )
        head = "<th>rank</th><th>peak host RSS</th>" + ("<th>peak device memory</th>" * device)
        return (
            f'<table class="nbaccel-memory-summary"><thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table>"
        )
