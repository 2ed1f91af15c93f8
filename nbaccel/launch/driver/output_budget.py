"""Bounded output for one call: what the notebook shows, and the full log of the rest.

A rank can print without limit (200k lines, a 50 MB line); a notebook cannot show it. Per call
(a launch, or one ``%%distributed`` cell) at most ``max_lines`` lines and ``max_chars``
characters are shown, each line cut at ``max_line_chars``. Nothing is dropped silently: the first
time anything is held back, every line of the call so far and from then on goes to a log file,
and a notice names the file; the call ends with a notice of what was held back. A call that
stays within the limits leaves no file behind; how much disk the logs of a kernel take, and
when they are removed, is ``nbaccel.launch.host.log_store``'s. Lines longer than the group reads at
once come in pieces; the log has one line per piece, marked ``(continued)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import IO

from nbaccel.launch.host.log_store import log_dir, store
from nbaccel.launch.wire.labels import LOCAL_LABELS, RankLabels
from nbaccel.launch.wire.protocol import Stream

__all__ = ["OutputBudget", "log_dir"]


class OutputBudget:
    """The output limits of a worker group, reset at the start of each call.

    Args:
        max_lines: lines shown per call (all ranks together).
        max_line_chars: characters shown of one line; the rest is in the log.
        max_chars: characters shown per call.
        notice: where the budget's notices go (the group sets its renderer's ``notice``).
        labels: how its notices name ranks (the group sets its own).
    """

    def __init__(
        self,
        max_lines: int = 2000,
        max_line_chars: int = 10_000,
        max_chars: int = 2_000_000,
        notice: Callable[[str], None] = lambda text: None,
        labels: RankLabels = LOCAL_LABELS,
    ) -> None:
        self.max_lines = max_lines
        self.max_line_chars = max_line_chars
        self.max_chars = max_chars
        self.notice = notice
        self.labels = labels
        self.path: str | None = None
        self._label = "launch"
        self.begin()

    def begin(self, label: str = "launch") -> None:
        """A new call starts: nothing shown yet, no log."""
        self.close()
        self._label = label
        self.lines = 0  # complete lines received
        self.shown_lines = 0
        self.shown_chars = 0
        self.held_lines = 0  # lines not shown at all
        self.cut_lines = 0  # lines shown cut short
        self.path = None
        self._log: IO[str] | None = None
        self._kept: list[str] = []  # the call's lines so far, for a log opened later
        self._kept_chars = 0
        self._over = False  # the line/char budget of the call is spent
        self._cut: set[tuple[int, str]] = set()  # (rank, stream) whose current line was cut
        self.dropped_lines = 0  # log lines past the disk budget of the kernel's logs

    def take(
        self, rank: int, stream: str, text: str, continues: bool, complete: bool
    ) -> str | None:
        """Account for one piece of output; the text to show, or None to show nothing.

        ``continues``: ``text`` continues the previous piece of this rank's stream (a line
        longer than the group reads at once); ``complete``: ``text`` ends its line.
        """
        # one log line per piece, so that ranks writing long lines at once do not interleave
        where = f"[{self.labels.label(rank)}]{' (stderr)' if stream == Stream.STDERR else ''}"
        self._record(f"{where}{' (continued)' if continues else ''} {text}\n")
        if complete:
            self.lines += 1
        key = (rank, stream)
        if continues:
            if key not in self._cut:  # the head was shown in full, the rest is too long now
                self._cut.add(key)
                self.cut_lines += 1
                self._open_log()
            if complete:
                self._cut.discard(key)
            return None
        if self._over or self.shown_lines >= self.max_lines or self.shown_chars >= self.max_chars:
            if not self._over:
                self._over = True
                self._open_log()
                self.notice(
                    f"output limit reached ({self.shown_lines} lines shown); the rest of this "
                    f"{self._label}'s output goes to {self.path}{store.exit_note()}"
                )
            if complete:
                self.held_lines += 1
            else:
                self._cut.add(key)  # its continuation is held back with it
            return None
        shown = text
        if len(text) > self.max_line_chars or not complete:
            self._open_log()
            cut = text[: self.max_line_chars]
            shown = f"{cut} ... [line cut: the whole line is in {self.path}]"
            self.cut_lines += 1
            if not complete:
                self._cut.add(key)
        self.shown_lines += 1
        self.shown_chars += len(shown)
        return shown

    def end(self) -> None:
        """The call is over: say what was held back and where it is, then close the log."""
        if self.path is not None and (self.held_lines or self.cut_lines):
            parts = []
            if self.held_lines:
                parts.append(f"{self.held_lines} of {self.lines} lines not shown")
            if self.cut_lines:
                parts.append(f"{self.cut_lines} long line(s) cut")
            where = f"the full output is in {self.path}{store.exit_note()}"
            if self.dropped_lines:
                mb = store.budget / 2**20
                where = (
                    f"the output is in {self.path}{store.exit_note()}, except its last "
                    f"{self.dropped_lines} lines: the logs of this process are limited to "
                    f"{mb:.0f} MB (NBACCEL_LOG_BUDGET_MB)"
                )
                if self._log is not None:  # a few bytes past the budget, to say where it ends
                    self._log.write(f"[nbaccel] {self.dropped_lines} more lines past the budget\n")
            self.notice(f"{'; '.join(parts)}: {where}")
        self.begin(self._label)

    def close(self) -> None:
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None

    # ------------------------------------------------------------------ the log
    def _write_log(self, text: str) -> None:
        if self._log is None or self.path is None:
            return
        if self.dropped_lines or not store.reserve(self.path, len(text.encode("utf-8", "replace"))):
            self.dropped_lines += 1
            return
        self._log.write(text)

    def _record(self, text: str) -> None:
        if self._log is not None:
            self._write_log(text)
        elif self._kept_chars + len(text) <= 4 * self.max_chars:
            self._kept.append(text)
            self._kept_chars += len(text)
        else:  # more than the budget keeps in memory: the log starts now, with all so far
            self._open_log()
            self._write_log(text)

    def _open_log(self) -> None:
        if self._log is not None:
            return
        self.path, self._log = store.open(self._label)
        for text in self._kept:
            self._write_log(text)
        self._kept = []
        self._kept_chars = 0
