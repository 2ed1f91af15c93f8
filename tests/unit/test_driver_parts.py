"""The parts a worker group holds, each on its own: the connection table (authenticated
connections, on real sockets), the end watcher (a rank's end as its exit code is reported),
the output reader (bytes to whole lines). No process is started: the ranks' side is played
by real client sockets in threads, and exit codes come as a fork server reports them."""

from __future__ import annotations

import os
import selectors
import socket
import threading
import time

from recorder import Recorder

from nbaccel.launch.driver.output_budget import OutputBudget
from nbaccel.launch.driver.output_reader import OutputReader
from nbaccel.launch.driver.rank_connections import (
    EVENTS,
    HANDSHAKE,
    LISTENER,
    OUTPUT,
    ConnectionTable,
)
from nbaccel.launch.driver.rank_ends import EndWatcher
from nbaccel.launch.driver.rank_state import RankState
from nbaccel.launch.host.processes import WorkerProcess
from nbaccel.launch.wire.channel import AuthenticationFailed, connect, new_secret
from nbaccel.launch.wire.protocol import OutcomeKind


class _Table:
    """A connection table on its own selector, for ranks 0 and 1 of launch ``abc``."""

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self.ranks = [RankState(0), RankState(1)]
        self.notices: list[str] = []
        self.secret = new_secret()
        by_rank = {r.rank: r for r in self.ranks}
        self.table = ConnectionTable(self.selector, by_rank, "abc", self.notices.append)
        self.listener = self.table.listen(self.secret, None, backlog=8)

    def serve(self, done, timeout: float = 10.0) -> None:
        """The group's loop, for connections only: until ``done()``."""
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            for key, _ in self.selector.select(0.05):
                kind = key.data[0]
                if kind == LISTENER:
                    self.table.start_handshake()
                elif kind == HANDSHAKE:
                    self.table.accept(key.fileobj)

    def connect_rank(self, header: dict, secret: bytes | None = None, fds=()):
        """A rank connecting from a thread while the table serves; its connection (or error)."""
        got: list = []

        def client() -> None:
            try:
                got.append(connect(self.listener.address, secret or self.secret, header, fds))
            except (AuthenticationFailed, OSError) as exc:
                got.append(exc)

        thread = threading.Thread(target=client)
        thread.start()
        self.serve(lambda: bool(got) and not self.table.handshakes)
        thread.join(10)
        return got[0]

    def keys(self, kind: str) -> list:
        return [k.data for k in self.selector.get_map().values() if k.data[0] == kind]

    def close(self) -> None:
        self.table.close()
        self.selector.close()


def _events_with_output(table: _Table, rank: int):
    """Rank ``rank`` connects its events, carrying its stdout and stderr as socket pairs (as a
    local rank does); (its events connection, its near ends of stdout and stderr)."""
    pairs = [socket.socketpair() for _ in range(2)]
    header = {"rank": rank, "launch": "abc", "stream": "events", "carries": ["stdout", "stderr"]}
    events = table.connect_rank(header, fds=[far.fileno() for _, far in pairs])
    for _, far in pairs:
        far.close()
    return events, pairs[0][0], pairs[1][0]


def test_a_rank_connects_its_events_and_carries_its_output():
    t = _Table()
    try:
        events, out, err = _events_with_output(t, 1)
        state = t.ranks[1]
        assert state.events is not None and state.connected == {"events", "stdout", "stderr"}
        assert state.streams_open == {"stdout", "stderr"}
        assert sorted(t.keys(EVENTS)) == [(EVENTS, 1, None)]
        assert sorted(t.keys(OUTPUT)) == [(OUTPUT, 1, "stderr"), (OUTPUT, 1, "stdout")]
        assert sorted(stream for _, stream in t.table.outputs.values()) == ["stderr", "stdout"]
        assert t.ranks[0].connected == set() and t.notices == []
        for sock in (events.sock, out, err):
            sock.close()
    finally:
        t.close()


def test_another_launch_or_an_unknown_rank_is_closed_and_registers_nothing():
    t = _Table()
    try:
        for header in (
            {"rank": 0, "launch": "other", "stream": "events"},
            {"rank": 7, "launch": "abc", "stream": "events"},
        ):
            conn = t.connect_rank(header)
            assert conn.sock.recv(1) == b""  # the driver closed its end
            conn.close()
        assert t.keys(EVENTS) == [] and t.keys(OUTPUT) == []
        assert all(not r.connected for r in t.ranks)
    finally:
        t.close()


def test_a_wrong_secret_is_refused_with_a_notice():
    t = _Table()
    try:
        got = t.connect_rank({"rank": 0, "launch": "abc", "stream": "events"}, new_secret())
        assert isinstance(got, (AuthenticationFailed, OSError))
        assert t.notices == ["refused a connection that failed authentication"]
        assert t.keys(EVENTS) == [] and not t.table.handshakes
    finally:
        t.close()


def test_a_silent_connection_is_dropped_past_its_deadline():
    t = _Table()
    silent = socket.socket(
        socket.AF_UNIX if t.listener.address.family == "unix" else socket.AF_INET
    )
    try:
        silent.connect(t.listener.address.location)
        t.serve(lambda: bool(t.table.handshakes))
        (handshake,) = t.table.handshakes
        t.table.expire_handshakes()
        assert t.table.handshakes == {handshake} and t.notices == []  # not due yet
        handshake.deadline = time.monotonic() - 1
        t.table.expire_handshakes()
        assert not t.table.handshakes and t.keys(HANDSHAKE) == []
        assert t.notices == ["dropped a connection that did not authenticate in time"]
    finally:
        silent.close()
        t.close()


def test_the_output_reader_passes_whole_lines_and_the_partial_last_at_the_end():
    t = _Table()
    shown = Recorder()
    budget = OutputBudget()
    budget.begin()
    reader = OutputReader(t.table, budget, shown)
    try:
        events, out, err = _events_with_output(t, 0)
        state = t.ranks[0]
        conns = {stream: conn for conn, (_, stream) in t.table.outputs.items()}
        out.sendall(b"first\nsecond\npart")
        assert reader.read(state, "stdout", conns["stdout"]) is False
        assert shown.lines == [(0, "stdout", "first"), (0, "stdout", "second")]
        reader.flush_printed(t.ranks)  # a call's end: the partial line goes too
        assert shown.lines[-1] == (0, "stdout", "part") and not state.printed
        err.sendall(b"oops\n")
        err.close()
        reader.drain()  # reads stderr to its end: the connection is closed and forgotten
        assert (0, "stderr", "oops") in shown.lines
        assert state.streams_open == {"stdout"} and list(t.table.outputs) == [conns["stdout"]]
        out.close()
        events.close()
    finally:
        t.close()


class _Reported:
    """Exit codes as a fork server reports them (``ExitReporter``), set by the test."""

    def __init__(self) -> None:
        self.codes: dict[int, int] = {}

    def exitcode(self, pid: int) -> int | None:
        return self.codes.get(pid)

    def ended_at(self, pid: int) -> float | None:
        return 100.0 if pid in self.codes else None

    def alive(self) -> bool:
        return True

    def describe_loss(self) -> str:
        return ""

    def forget(self, pid: int) -> None:
        pass


def _watched(tmp_path, ranks: list[RankState], selector=None) -> EndWatcher:
    def error_path(rank: int) -> str:
        return str(tmp_path / f"rank-{rank}.error")

    selector = selector or selectors.DefaultSelector()
    return EndWatcher(ranks, selector, lambda done, timeout: done(), error_path)


def test_a_dead_busy_rank_gets_its_crash_once_its_streams_are_drained(tmp_path):
    reported = _Reported()
    state = RankState(3, process=WorkerProcess(os.getpid(), "forkserver", server=reported))
    state.ready, state.busy_since, state.connected = True, 1.0, {"events"}
    watcher = _watched(tmp_path, [state])
    assert watcher.check(current_call=5) == 0 and watcher.dead_unreported(5) == []
    reported.codes[os.getpid()] = 3
    assert watcher.dead_unreported(5) == [3]
    assert watcher.check(5) == 0  # dead, but its streams may still hold its last words
    state.drain_deadline = state.drain_limit = time.monotonic() - 1  # silent long enough
    assert watcher.check(5) == 1
    crash = state.outcomes[5]
    assert (crash.kind, crash.value, crash.at, crash.secondary) == (
        OutcomeKind.CRASH,
        3,
        100.0,
        False,
    )
    assert state.busy_since is None and watcher.dead_unreported(5) == []
    assert watcher.check(5) == 0  # recorded once


def test_data_still_waiting_keeps_a_dead_rank_draining(tmp_path):
    reported = _Reported()
    state = RankState(0, process=WorkerProcess(os.getpid(), "forkserver", server=reported))
    state.ready, state.busy_since = True, 1.0
    selector = selectors.DefaultSelector()
    near, far = socket.socketpair()
    selector.register(near, selectors.EVENT_READ, (EVENTS, 0, None))
    watcher = _watched(tmp_path, [state], selector)
    try:
        reported.codes[os.getpid()] = 0
        watcher.check(1)
        far.sendall(b"its result, not read yet")
        state.drain_deadline = time.monotonic() - 1
        assert watcher.check(1) == 0 and state.drain_deadline > time.monotonic()
        assert 1 not in state.outcomes
    finally:
        selector.close()
        near.close()
        far.close()


def test_a_rank_that_never_connected_ends_its_start_with_the_reason_it_wrote(tmp_path):
    reported = _Reported()
    state = RankState(1, process=WorkerProcess(os.getpid(), "forkserver", server=reported))
    state.events_closed, state.stopped = True, True  # nothing to drain; the driver stopped it
    (tmp_path / "rank-1.error").write_text("it could not connect to the notebook's channel")
    watcher = _watched(tmp_path, [state])
    reported.codes[os.getpid()] = -15
    assert watcher.check(current_call=None) == 1
    start = state.outcomes[0]
    assert start.value == -15 and start.secondary
    assert start.detail == "it could not connect to the notebook's channel"
