"""Replay a run's journal into a renderer: what was recorded so far, then live until it ends.

The same calls the driver made on the recording renderer are made on ``renderer`` (the
notebook's widgets, or text), in order: a re-attached notebook sees what a launch shows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from nbaccel.launch.detached.folder import RunFolder
from nbaccel.launch.detached.journal import JournalReader
from nbaccel.launch.driver.renderer import Renderer
from nbaccel.launch.wire.protocol import EventKind, Stream

__all__ = ["Replay", "apply_record"]

_POLL = 0.1


def _word(kind: Any, vocabulary: type) -> Any:
    try:
        return vocabulary(kind)
    except ValueError:
        return kind


def apply_record(renderer: Renderer, record: tuple) -> None:
    """Make on ``renderer`` the call that ``record`` (a
    :class:`~nbaccel.launch.detached.recorder.RelayRenderer`'s) stands for."""
    kind, *fields = record
    r = renderer
    if kind == "line":
        rank, stream, text = fields
        r.line(rank, _word(stream, Stream), text)
    elif kind == "over":
        rank, stream, text = fields
        r.overflow(rank, _word(stream, Stream), text)
    elif kind == "event":
        rank, event, payload = fields
        r.event(rank, _word(event, EventKind), payload)
    elif kind == "notice":
        r.notice(fields[0])
    elif kind == "labels":
        r.use_labels(fields[0])
    elif kind == "start":
        r.start(*fields)
    elif kind == "finish":
        r.finish(*fields)


class Replay:
    """Feeds ``folder``'s journal to ``renderer``, from the start.

    A launch that was started but not finished when the replay stops (the user detached) is
    left open: the renderer's ``finish`` is called only for recorded ends.
    """

    def __init__(self, folder: RunFolder, renderer: Renderer) -> None:
        self.folder = folder
        self.renderer = renderer
        self.reader = JournalReader(folder.file("journal.bin"))
        self.open = False  # a recorded launch started and not yet finished

    def step(self) -> int:
        """Replay the records written since the last step; how many."""
        records = self.reader.read()
        for record in records:
            self._apply(record)
        return len(records)

    def _apply(self, record: tuple) -> None:
        apply_record(self.renderer, record)
        if record[0] in ("start", "finish"):
            self.open = record[0] == "start"

    def run(
        self,
        follow: bool = True,
        stop: threading.Event | None = None,
        ended: Callable[[], bool] | None = None,
    ) -> None:
        """Replay everything so far; with ``follow``, keep going until the run has ended and
        its journal is read to the end (or ``stop`` is set)."""
        ended = ended or (lambda: self.folder.info().ended_)
        self.step()
        while follow and not (stop is not None and stop.is_set()):
            over = ended()  # read before the journal: nothing written before the end is missed
            if self.step() == 0 and over:
                return
            time.sleep(_POLL)
