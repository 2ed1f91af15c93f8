"""Live progress bars from the ranks: one row per (rank, tqdm bar), labelled with the rank.

Fed by :class:`~nbaccel.notebook.events.ProgressUpdate` events (already coalesced on the rank).
A bar closed with ``leave=False`` disappears, as in tqdm; the final states are kept for the
launch summary (text and HTML twins of the widgets).
"""

from __future__ import annotations

import html
from collections.abc import Callable

import ipywidgets as widgets

from nbaccel.launch.wire.labels import LOCAL_LABELS
from nbaccel.notebook.events import ProgressUpdate

__all__ = ["ProgressBoard"]

_STATS = "{n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
_STATS_NO_TOTAL = "{n_fmt} [{elapsed}, {rate_fmt}{postfix}]"


def _stats(update: ProgressUpdate) -> str:
    from tqdm.std import tqdm as std_tqdm

    return std_tqdm.format_meter(
        update.n,
        update.total,
        update.elapsed,
        prefix="",
        unit=update.unit,
        unit_scale=update.unit_scale,
        rate=update.rate,
        postfix=update.postfix,
        unit_divisor=update.unit_divisor,
        bar_format=_STATS if update.total else _STATS_NO_TOTAL,
    )


def _label(rank: int, update: ProgressUpdate) -> str:
    desc = html.escape(update.desc.rstrip(": ")) if update.desc else ""
    rank_tag = f"<b>rank {rank}</b>"
    return f"{rank_tag} · {desc}" if desc else rank_tag


class _BarRow:
    """One bar: ``rank N · desc  [=====   ]  45% 450/1000 [00:01<00:02, 300it/s]`` (two widget
    messages per update: the bar, and one HTML for the numbers)."""

    def __init__(self, rank: int, update: ProgressUpdate) -> None:
        self.rank = rank
        self.label = widgets.HTML(_label(rank, update), layout=widgets.Layout(width="13em"))
        self.bar = widgets.FloatProgress(
            min=0.0, max=1.0, layout=widgets.Layout(flex="1 1 0%", min_width="8em")
        )
        self.stats = widgets.HTML(layout=widgets.Layout(width="26em"))
        self.box = widgets.HBox([self.label, self.bar, self.stats])
        self.box.add_class("nbaccel-bar")
        self.box.add_class(f"nbaccel-rank-{rank}")
        self.last = update

    def show(self, update: ProgressUpdate) -> None:
        self.last = update
        with self.bar.hold_sync():
            if update.total:
                self.bar.max = float(update.total)
                self.bar.value = float(min(update.n, update.total))
            else:  # unknown length: a full "info" bar, as tqdm's notebook front end does
                self.bar.max, self.bar.value = 1.0, 1.0
                self.bar.bar_style = "info"
            if update.final and update.total:
                self.bar.bar_style = "success" if update.n >= update.total else "danger"
        label = _label(self.rank, update)
        if label != self.label.value:
            self.label.value = label
        percent = f"{100 * update.n / update.total:3.0f}% " if update.total else ""
        text = html.escape(percent + _stats(update))
        self.stats.value = f'<span style="white-space:nowrap">&nbsp;{text}</span>'


class ProgressBoard:
    """All bars of a launch, ordered by rank, then by creation on that rank."""

    def __init__(self, label: Callable[[int], str] = LOCAL_LABELS.label) -> None:
        self.label = label  # how the summary names a rank (its renderer's labels)
        self.box = widgets.VBox([])
        self.box.add_class("nbaccel-progress")
        self._rows: dict[tuple[int, int], _BarRow] = {}
        self.finals: dict[tuple[int, int], ProgressUpdate] = {}

    def update(self, rank: int, update: ProgressUpdate) -> None:
        key = (rank, update.bar)
        row = self._rows.get(key)
        if row is None:
            if update.final and not update.leave:
                return
            row = self._rows[key] = _BarRow(rank, update)
            self._relayout()
        row.show(update)
        if update.final:
            if update.leave:
                self.finals[key] = update
            else:
                del self._rows[key]
                self._relayout()

    def _relayout(self) -> None:
        self.box.children = tuple(self._rows[k].box for k in sorted(self._rows))

    def finish(self, ok: bool) -> None:
        """Bars still open when the launch ends (a failed rank) turn red."""
        for key, row in self._rows.items():
            if key not in self.finals:
                row.bar.bar_style = "danger" if not ok else row.bar.bar_style
                self.finals[key] = row.last

    def summary_lines(self) -> list[str]:
        """The final state of every bar, as tqdm prints it."""
        return [
            f"[{self.label(rank)}] {self.finals[rank, bar].meter()}"
            for rank, bar in sorted(self.finals)
        ]
