"""The renderer of a detached launch: every call goes into the run's journal.

:class:`RecordingRenderer` is a :class:`~nbaccel.launch.driver.renderer.Renderer` like the
notebook's: the driver loop calls it the same way, and it writes each call as a journal record
(``("line", rank, stream, text)``, ``("event", rank, kind, payload)``, ...), so that a replay
(:mod:`nbaccel.launch.detached.replay`) makes the same calls on another renderer later. It also
keeps ``run.json``'s last line current (rewritten at most once a second).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from nbaccel.launch.detached.folder import RunFolder
from nbaccel.launch.detached.journal import JournalWriter
from nbaccel.launch.driver.renderer import Renderer
from nbaccel.launch.wire.labels import RankLabels
from nbaccel.launch.wire.protocol import Stream

__all__ = ["RecordingRenderer", "RelayRenderer"]

_INFO_INTERVAL = 1.0
_LAST_LINE_CHARS = 200


class RelayRenderer(Renderer):
    """Turns each renderer call into a record (``("line", rank, stream, text)``, ...) handed to
    ``write``: into a journal, or down a detached pool's link to the attached kernel, where
    :func:`~nbaccel.launch.detached.replay.apply_record` makes the same call again."""

    def __init__(self, write: Callable[[tuple], None]) -> None:
        self.write = write

    def use_labels(self, labels: RankLabels) -> None:
        super().use_labels(labels)
        self.write(("labels", labels))

    def start(self, announcement: str, num_processes: int) -> None:
        self.write(("start", announcement, num_processes))

    def line(self, rank: int, stream: Stream, text: str) -> None:
        self.write(("line", rank, str(stream), text))

    def overflow(self, rank: int, stream: Stream, text: str) -> None:
        self.write(("over", rank, str(stream), text))

    def event(self, rank: int, kind: Any, payload: Any) -> None:
        self.write(("event", rank, str(kind), payload))

    def notice(self, text: str) -> None:
        self.write(("notice", text))

    def finish(self, ok: bool, failed: list[int] | None = None) -> None:
        self.write(("finish", ok, failed))


class RecordingRenderer(RelayRenderer):
    """Writes a launch's renderer calls into ``folder``'s journal."""

    def __init__(self, folder: RunFolder) -> None:
        self.folder = folder
        self.journal = JournalWriter(folder.file("journal.bin"))
        super().__init__(self.journal.write)
        self._last_line = ""
        self._info_at = 0.0

    def line(self, rank: int, stream: Stream, text: str) -> None:
        super().line(rank, stream, text)
        self._note_line(rank, text)

    def overflow(self, rank: int, stream: Stream, text: str) -> None:
        super().overflow(rank, stream, text)
        self._note_line(rank, text)

    def finish(self, ok: bool, failed: list[int] | None = None) -> None:
        super().finish(ok, failed)
        self.flush_info()

    def _note_line(self, rank: int, text: str) -> None:
        self._last_line = f"{self.labels.prefix(rank)}{text}"[:_LAST_LINE_CHARS]
        if time.monotonic() - self._info_at >= _INFO_INTERVAL:
            self.flush_info()

    def flush_info(self) -> None:
        """Write the last line seen into ``run.json`` now."""
        self._info_at = time.monotonic()
        if self._last_line:
            self.folder.update(last_line=self._last_line)

    def close(self) -> None:
        """The run is over: the last line, the journal's closing notice."""
        self.flush_info()
        self.journal.close()
