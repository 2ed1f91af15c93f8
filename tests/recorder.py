"""A renderer that keeps what a launch shows, for assertions (tests/ is on sys.path).

from recorder import Recorder
shown = Recorder()
notebook_launcher(work, num_processes=2, renderer=shown)
assert (1, "stdout", "ready") in shown.lines and "ready" in shown.text(rank=1)
"""

from __future__ import annotations

import time

from nbaccel.launch.driver.renderer import Renderer

__all__ = ["Recorder"]


class Recorder(Renderer):
    """Lines as (rank, stream, text), notices, events as (monotonic time, rank, kind,
    payload), and the launch's announcement."""

    def __init__(self) -> None:
        self.lines: list[tuple[int, str, str]] = []
        self.notices: list[str] = []
        self.events: list[tuple[float, int, str, object]] = []
        self.announcement = ""

    def start(self, announcement: str, num_processes: int) -> None:
        self.announcement = announcement

    def line(self, rank: int, stream: str, text: str) -> None:
        self.lines.append((rank, stream, text))

    def notice(self, text: str) -> None:
        self.notices.append(text)

    def event(self, rank: int, kind: str, payload: object) -> None:
        self.events.append((time.monotonic(), rank, kind, payload))

    def text(self, rank: int | None = None) -> str:
        """What ``rank`` (default every rank) printed, one line per line shown."""
        return "\n".join(t for r, _, t in self.lines if rank is None or r == rank)
