"""How a worker group's ranks connect: authenticated handshakes, then their three streams.

Every connection to the group's listener proves the launch secret (``channel.Handshake``)
before anything it sends is unpickled; one that does not in time is dropped, with a notice. Over
TCP a rank opens three connections (stdout, stderr, events). On a Unix socket it opens one,
events, whose header carries the driver's ends of two socket pairs for its output (SCM_RIGHTS):
one handshake per rank instead of three, which a launch of many ranks on few cores feels.

:class:`ConnectionTable` does it for a :class:`~nbaccel.launch.driver.group.WorkerGroup`: it
owns the listener, the handshakes in progress and the ranks' output connections.
"""

from __future__ import annotations

import os
import selectors
import socket
import time
from collections.abc import Callable
from typing import Any

from nbaccel.launch.driver.lines import StreamLines
from nbaccel.launch.driver.rank_state import RankState
from nbaccel.launch.wire.channel import AuthenticationFailed, Connection, Handshake, Listener
from nbaccel.launch.wire.protocol import Stream

__all__ = ["EVENTS", "HANDSHAKE", "LISTENER", "OUTPUT", "ConnectionTable"]

# what a ready selector key carries (its data: (kind, rank, stream)): the listener, a connection
# still proving the secret, a rank's event connection, one of its output connections
LISTENER, HANDSHAKE, EVENTS, OUTPUT = "listener", "handshake", "events", "output"
_OUTPUT_STREAMS = (Stream.STDOUT.value, Stream.STDERR.value)


class ConnectionTable:
    """The connections of one launch's ranks, registered on ``selector`` as they authenticate.

    Args:
        selector: the group's selector; each connection is registered with its key data.
        by_rank: the ranks that may connect, by rank (a connection names its rank).
        launch_id: what a connection's header must carry (a rank of another launch is refused).
        notice: where a dropped or refused connection is said.
    """

    def __init__(
        self,
        selector: selectors.BaseSelector,
        by_rank: dict[int, RankState],
        launch_id: str,
        notice: Callable[[str], None],
    ) -> None:
        self._selector = selector
        self._by_rank = by_rank
        self.launch_id = launch_id
        self._notice = notice
        self.listener: Listener | None = None
        self.handshakes: set[Handshake] = set()
        #: the ranks' open output connections (each call's end reads what they hold)
        self.outputs: dict[Connection, tuple[RankState, str]] = {}

    def listen(self, secret: bytes, host: str | None, backlog: int) -> Listener:
        """Open the listener the ranks connect to, registered with the key data ``LISTENER``."""
        self.listener = Listener(secret, host, backlog=backlog)
        self._selector.register(self.listener, selectors.EVENT_READ, (LISTENER, None, None))
        return self.listener

    def error_path(self, rank: int) -> str | None:
        """Where ``rank`` writes why it could not connect (None before :meth:`listen`)."""
        if self.listener is None:
            return None
        return self.listener.private_path(f"rank-{rank}.error")

    def start_handshake(self) -> None:
        """A connection waits on the listener: start proving its secret."""
        try:
            handshake = self.listener.start_handshake()
        except OSError:
            return
        self._selector.register(handshake, selectors.EVENT_READ, (HANDSHAKE, None, None))
        self.handshakes.add(handshake)

    def expire_handshakes(self) -> None:
        """Drop the connections that did not authenticate in time."""
        now = time.monotonic()
        for handshake in [h for h in self.handshakes if h.deadline < now]:
            self._drop_handshake(handshake)
            handshake.close()
            self._notice("dropped a connection that did not authenticate in time")

    def _drop_handshake(self, handshake: Handshake) -> None:
        self.handshakes.discard(handshake)
        self._selector.unregister(handshake)

    def accept(self, handshake: Handshake) -> None:
        """Advance ``handshake``; once proven, register the rank's stream(s) it brings."""
        try:
            conn = handshake.advance()
        except AuthenticationFailed:
            self._drop_handshake(handshake)
            self._notice("refused a connection that failed authentication")
            return
        if conn is None:
            return
        self._drop_handshake(handshake)
        header = conn.header
        state = self._by_rank.get(header.get("rank"))
        if state is None or header.get("launch") != self.launch_id:
            conn.close()
            return
        stream, fds, conn.fds = header.get("stream"), conn.fds, []
        carried = dict(zip(fds, header.get("carries", ()) if stream == Stream.EVENTS else ()))
        for fd in fds:
            if fd in carried:
                self._add_output(state, carried[fd], socket.socket(fileno=fd))
            else:  # more than announced: not the rank's to give
                os.close(fd)
        if stream == Stream.EVENTS:
            state.connected.add(stream)
            state.events = conn
            self._selector.register(conn, selectors.EVENT_READ, (EVENTS, state.rank, None))
        else:
            self._add_output(state, stream, conn.sock)

    def _add_output(self, state: RankState, stream: Any, sock: socket.socket) -> None:
        """Read the rank's ``stream`` (stdout or stderr) from ``sock``."""
        if stream not in _OUTPUT_STREAMS or stream in state.connected:
            sock.close()
            return
        state.connected.add(stream)
        state.streams_open.add(stream)
        state.lines[stream] = StreamLines()
        sock.setblocking(False)
        conn = Connection(sock)
        self._selector.register(conn, selectors.EVENT_READ, (OUTPUT, state.rank, stream))
        self.outputs[conn] = (state, stream)

    def close_output(self, conn: Connection) -> None:
        """``conn``'s stream ended: forget it."""
        self._selector.unregister(conn)
        self.outputs.pop(conn, None)
        conn.close()

    def close_events(self, state: RankState) -> None:
        """``state``'s event connection ended: forget it."""
        self._selector.unregister(state.events)
        state.events.close()
        state.events_closed = True

    def close(self) -> None:
        """Close every connection still registered, and the listener."""
        for key in list(self._selector.get_map().values()):
            if isinstance(key.fileobj, (Connection, Handshake)):
                self._selector.unregister(key.fileobj)
                key.fileobj.close()
        self.handshakes.clear()
        self.outputs.clear()
        if self.listener is not None:
            self.listener.close()
