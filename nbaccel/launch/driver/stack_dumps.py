"""A rank's Python stack dumps as the notebook shows them: the user's frames, not nbaccel's.

A rank dumps the stack of every thread (``faulthandler``, to its stderr) when it crashes in
native code, and when the driver asks at a timeout or at a stop the rank did not hear
(``STACKS_SIGNAL``). Half of each dump was nbaccel's own: the rank's watcher thread, a block
of its own, and under the user's frames the worker and the fork server that called them, down
to the server's ``<string>`` bootstrap. They are left out: the same files as in a rank's
tracebacks (``tracebacks.internal_frame``). Everything else is kept as faulthandler wrote it:
the user's frames and threads (a DataLoader's, their own), library frames (``barrier``), and
the lines around a dump ("Fatal Python error: Segmentation fault", the extension modules).
"""

from __future__ import annotations

import re

from nbaccel.launch.wire.tracebacks import internal_frame

__all__ = ["StackDumpFilter"]

_HEADER = re.compile(r"(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):")
_FRAME = re.compile(r'  File "(?P<file>.*)", line (?:\d+|\?\?\?) in .*')
_WATCHER = re.compile(r"[/\\]nbaccel[/\\]launch[/\\]rank[/\\]watch\.py")


class StackDumpFilter:
    """Fed one rank's stderr line by line; returns the lines to show. A thread's header waits
    for its first frame (the watcher's block goes whole); nothing else is held."""

    def __init__(self) -> None:
        self._header: str | None = None  # a thread's header, until its first frame says whose
        self._in_dump = False
        self._skipping = False  # inside the watcher thread's block
        self._below_engine = False  # the frames under the engine's are its bootstrap

    def feed(self, line: str) -> list[str]:
        if _HEADER.fullmatch(line):
            shown = self.flush()
            self._header, self._in_dump = line, True
            self._skipping = self._below_engine = False
            return shown
        if not self._in_dump:
            return [line]
        frame = _FRAME.fullmatch(line)
        shown = []
        if self._header is not None:
            header, self._header = self._header, None
            if frame is not None and _WATCHER.search(frame["file"]):
                self._skipping = True
                return []
            shown.append(header)
        if self._skipping:
            self._skipping = line != ""  # the blank line after the block ends it
            return shown
        if frame is None:
            self._in_dump = line == "" or line.startswith("  ")  # "  <no Python frame>", "  ..."
            return [*shown, line]
        file = frame["file"]
        if internal_frame(file) or (self._below_engine and file == "<string>"):
            self._below_engine = True
            return shown
        self._below_engine = False
        return [*shown, line]

    def flush(self) -> list[str]:
        """What is held (a header whose frames never came)."""
        header, self._header = self._header, None
        return [] if header is None else [header]
