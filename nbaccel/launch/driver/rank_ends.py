"""How a worker group's ranks end: seen from their exit status, and brought about by signals.

A rank's death is known from its process (the exit code its launcher reports), never from the
end of its output: a process the rank started may hold its stdout open and keep writing. Once
dead, its streams are read to their end or for a bounded time (:data:`DRAIN_IDLE` of silence,
at most :data:`DRAIN_MAX`), so its last words and its result still arrive, and then its crash is
recorded as the outcome of the call it had not answered. Stopping is the other direction:
a signal to every rank and its descendants, escalated to SIGKILL after a grace period.

:class:`EndWatcher` does both for a :class:`~nbaccel.launch.driver.group.WorkerGroup`.
"""

from __future__ import annotations

import selectors
import signal
import time
from collections.abc import Callable, Iterable

from nbaccel.launch.driver.rank_connections import EVENTS, OUTPUT
from nbaccel.launch.driver.rank_state import Outcome, RankState
from nbaccel.launch.wire.channel import readable
from nbaccel.launch.wire.protocol import STACKS_SIGNAL, Message, OutcomeKind

__all__ = ["DRAIN_IDLE", "DRAIN_MAX", "EndWatcher", "still_draining"]

DRAIN_IDLE = 1.0  # s of silence after which a dead rank's open streams count as drained
# at most this long after its death is seen, a dead rank's output is waited for: a process it
# started may hold its stdout open and keep writing (its death comes from its exit status)
DRAIN_MAX = 1.5


def still_draining(state: RankState) -> None:
    """Something was read from ``state``'s rank: if it is dead, wait for its streams longer."""
    if state.drain_deadline is not None:
        state.drain_deadline = time.monotonic() + DRAIN_IDLE


class EndWatcher:
    """Sees the ends of ``ranks`` and stops them.

    Args:
        ranks: the group's rank states (shared: the group records their outcomes too).
        selector: where the ranks' connections are registered (a dead rank's waiting data).
        pump_until: the group's loop, ``pump_until(done, timeout) -> bool``, run while waiting
            for ranks to exit.
        error_path: where a rank writes why it could not connect (``None``: nowhere yet).
    """

    def __init__(
        self,
        ranks: list[RankState],
        selector: selectors.BaseSelector,
        pump_until: Callable[[Callable[[], bool], float | None], bool],
        error_path: Callable[[int], str | None],
    ) -> None:
        self._ranks = ranks
        self._by_rank = {r.rank: r for r in ranks}
        self._selector = selector
        self._pump_until = pump_until
        self._error_path = error_path

    # ------------------------------------------------------------------ ends seen
    def check(self, current_call: int | None) -> int:
        """Record the crash of each rank whose process ended and whose streams are drained,
        as the outcome of ``current_call`` (when it was busy with it) or of its start (when it
        never became ready); how many outcomes were recorded."""
        recorded = 0
        for state in self._ranks:
            if state.process is None or state.process.poll() is None:
                continue
            # The process is gone: its sockets hit EOF shortly; drain them first.
            if not state.finished_io and not self._drained(state):
                continue
            code = state.process.poll()
            crash = Outcome(
                OutcomeKind.CRASH,
                code,
                state.process.ended_at or time.time(),  # when it died, not when drained
                secondary=state.stopped,
                detail=self._crash_detail(state),
                lost=bool(state.process.lost),
            )
            pending = current_call if state.busy_since is not None else None
            if pending is not None and pending not in state.outcomes:
                state.outcomes[pending] = crash
                state.busy_since = None
                recorded += 1
            if not state.ready and not state.outcomes:
                state.outcomes[0] = crash
                recorded += 1
        return recorded

    def _drained(self, state: RankState) -> bool:
        """True once a dead process's streams were read to the end, or stayed silent for
        ``DRAIN_IDLE`` seconds with nothing waiting. Each read moves that deadline, so a slow
        renderer still gets every message (the result included) that the rank sent before it
        ended; but output from a process the rank started, holding its stdout open, is waited
        for at most ``DRAIN_MAX`` seconds: the rank's death is known from its exit status."""
        now = time.monotonic()
        if state.drain_deadline is None:
            state.drain_deadline = now + DRAIN_IDLE
            state.drain_limit = now + DRAIN_MAX
            return False
        if state.finished_io:
            return True
        if now <= state.drain_deadline and now <= state.drain_limit:
            return False
        # a slow renderer may have kept the loop from reading: data waiting is not drained
        # (past the limit, only the rank's own event stream counts; a child may write forever)
        late = now > state.drain_limit
        kinds = (EVENTS,) if late else (EVENTS, OUTPUT)
        waiting = [
            key.fileobj
            for key in self._selector.get_map().values()
            if key.data[0] in kinds and key.data[1] == state.rank
        ]
        if readable(waiting):
            still_draining(state)
            return False
        return True

    def _crash_detail(self, state: RankState) -> str:
        """What is known beyond the exit code: the fork server's death, or the reason a rank
        wrote down when it could not connect to this driver."""
        if state.process is not None and state.process.lost:
            return state.process.lost
        path = self._error_path(state.rank)
        if path is None or state.connected:
            return ""
        try:
            with open(path) as handle:
                return handle.read(2000).strip()
        except OSError:
            return ""

    def dead_unreported(self, call_id: int) -> list[int]:
        """Ranks whose process has ended without an outcome for ``call_id`` recorded yet."""
        return [
            r.rank
            for r in self._ranks
            if call_id not in r.outcomes and r.process is not None and r.process.poll() is not None
        ]

    # ------------------------------------------------------------------ stopping
    def signal_all(self, sig: int, ranks: Iterable[int] | None = None) -> None:
        """Send ``sig`` to ``ranks`` (default all) and everything they started."""
        targets = self._by_rank if ranks is None else ranks
        for rank in targets:
            state = self._by_rank[rank]
            if state.process is not None:
                if state.process.poll() is None:
                    state.stopped = True
                state.process.signal_tree(sig)

    def dump_stacks(self, ranks: Iterable[int]) -> bool:
        """Ask ``ranks`` to print every thread's Python stack to their stderr (a call timed
        out on them); False where the platform has no signal for it. Only ranks that connected
        have set the signal up (before that it would end them)."""
        if STACKS_SIGNAL is None:
            return False
        for rank in ranks:
            state = self._by_rank[rank]
            if state.process is not None and state.connected:
                state.process.signal(STACKS_SIGNAL)
        return True

    def ignoring(self, sig: int, ranks: Iterable[int]) -> list[int]:
        """Those of ``ranks`` whose process ignores ``sig`` (signalling them again with it, or
        waiting for them to react, is pointless)."""
        return [
            rank
            for rank in ranks
            if (process := self._by_rank[rank].process) is not None and process.ignores(sig)
        ]

    def release(self) -> None:
        """Tell one-shot ranks that every rank has reported: they may exit now."""
        for state in self._ranks:
            if state.events is not None and not state.events_closed:
                try:
                    state.events.send((Message.RELEASE,))
                except OSError:
                    pass

    def wait_exit(self, timeout: float) -> bool:
        """Pump until every rank's process has ended; False when ``timeout`` s passed first."""
        return self._pump_until(
            lambda: all(r.process is None or r.process.poll() is not None for r in self._ranks),
            timeout,
        )

    def stop(self, grace: float = 2.0, first: int = signal.SIGTERM) -> None:
        """Stop every rank: ``first`` signal, then SIGKILL after ``grace`` seconds."""
        if first == signal.SIGINT:
            self.signal_all(signal.SIGINT)
            running = [r.rank for r in self._ranks if r.process and r.process.poll() is None]
            deaf = self.ignoring(signal.SIGINT, running) == running  # no use waiting on them
            if not deaf and self.wait_exit(grace):
                return
            first = signal.SIGTERM
        self.signal_all(first)
        if not self.wait_exit(grace):
            self.signal_all(signal.SIGKILL)
            self.wait_exit(5.0)
