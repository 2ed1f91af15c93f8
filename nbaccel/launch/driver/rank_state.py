"""What the driver knows of each rank, and how a rank's call ended (:class:`Outcome`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from nbaccel.launch.driver.lines import StreamLines
from nbaccel.launch.driver.stack_dumps import StackDumpFilter
from nbaccel.launch.host.processes import WorkerProcess
from nbaccel.launch.wire.channel import Connection
from nbaccel.launch.wire.protocol import OutcomeKind

__all__ = ["Outcome", "RankState"]


@dataclass
class Outcome:
    """How one rank's call ended: a value, an error (info dict) or a crash (exit code)."""

    kind: OutcomeKind
    value: Any = None
    at: float = field(default_factory=time.time)
    #: a consequence, not a cause: the rank was stopped by the driver, or its error is a broken
    #: connection to a peer that failed first (see ``errors.is_peer_loss``)
    secondary: bool = False
    detail: str = ""  # what else is known about a crash (why the rank could not connect...)
    lost: bool = False  # the process did not end by itself: ``detail`` says what took it


@dataclass
class RankState:
    """What the driver knows of one rank: its process, connections, calls and outcomes."""

    rank: int
    process: WorkerProcess | None = None
    events: Connection | None = None
    streams_open: set[str] = field(default_factory=set)
    lines: dict[str, StreamLines] = field(default_factory=dict)  # output streams, cut in lines
    printed: bool = False  # output came since the last call's end (its last line may be partial)
    stack_dump: StackDumpFilter = field(default_factory=StackDumpFilter)  # stderr's stack dumps
    connected: set[str] = field(default_factory=set)
    ready: bool = False
    events_closed: bool = False
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    busy_since: float | None = None
    drain_deadline: float | None = None  # set when the process is seen dead; moved by reads
    drain_limit: float | None = None  # the latest the dead process's streams are waited for
    stopped: bool = False  # the driver signalled it to stop (its end is not a cause)
    output_at: float = 0.0  # monotonic time output last came from the rank's streams

    @property
    def finished_io(self) -> bool:
        return self.events_closed and not self.streams_open
