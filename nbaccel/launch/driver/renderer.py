"""How a launch looks in the notebook: one interface, several front ends.

The driver turns worker events into calls on a :class:`Renderer`. :class:`TextRenderer` prints
rank-labelled lines (terminal, nbconvert, CI logs); the notebook package adds widget renderers fed
by the very same calls, so tests can assert on text and the browser lane on widgets.
"""

from __future__ import annotations

import sys
from typing import Any

from nbaccel.launch.wire.labels import LOCAL_LABELS, RankLabels
from nbaccel.launch.wire.protocol import EventKind, Stream

__all__ = ["Renderer", "TextRenderer"]


class Renderer:
    """Receives everything a launch shows. Subclasses override what they display."""

    #: how the ranks of the launch being shown are named (set by its worker group)
    labels: RankLabels = LOCAL_LABELS

    def use_labels(self, labels: RankLabels) -> None:
        """Name ranks with ``labels`` from now on (the worker group whose output this shows)."""
        self.labels = labels

    def rank_label(self, rank: int) -> str:
        """``rank 5``, or ``rank 5 @ node2`` for a rank on another host."""
        return self.labels.label(rank)

    def start(self, announcement: str, num_processes: int) -> None:
        """The launch begins: ``announcement`` says what runs where."""

    def line(self, rank: int, stream: Stream, text: str) -> None:
        """One whole output line (without its newline) from ``rank``'s stdout or stderr."""

    def overflow(self, rank: int, stream: Stream, text: str) -> None:
        """A line (or piece of one) beyond the call's output limit: not to be printed; the
        full log has it. A renderer may keep a bounded tail of these."""

    def event(self, rank: int, kind: EventKind, payload: Any) -> None:
        """A structured event from a rank (progress, memory, display, ...)."""

    def notice(self, text: str) -> None:
        """A message from nbaccel itself (restarts, stopping ranks, ...)."""

    def finish(self, ok: bool, failed: list[int] | None = None) -> None:
        """The launch is over (``ok`` False when it failed or was interrupted); ``failed``:
        the ranks whose own failure it was (not those stopped because of it), when known."""


class TextRenderer(Renderer):
    """Plain text: ``[rank N] line`` on the driver's stdout/stderr."""

    def __init__(self, quiet: bool = False, label: bool = True) -> None:
        self.quiet = quiet
        self.label = label

    def start(self, announcement: str, num_processes: int) -> None:
        if not self.quiet and announcement:
            print(announcement, flush=True)

    def line(self, rank: int, stream: Stream, text: str) -> None:
        target = sys.stderr if stream == Stream.STDERR else sys.stdout
        prefix = self.labels.prefix(rank) if self.label else ""
        target.write(f"{prefix}{text}\n")
        target.flush()

    def event(self, rank: int, kind: EventKind, payload: Any) -> None:
        render = getattr(payload, "render_text", None)
        if callable(render):
            text = render()
            if text:
                self.line(rank, Stream.STDOUT, text)

    def notice(self, text: str) -> None:
        print(f"[nbaccel] {text}", file=sys.stderr, flush=True)
