"""How a worker group's ranks connect: authenticated handshakes, then their three streams.

Every connection to the group's listener proves the launch secret (``channel.Handshake``)
before anything it sends is unpickled; one that does not in time is dropped, with a notice. Over
TCP a rank opens three connections (stdout, stderr, events). On a Unix socket it opens one,
events, whose header carries the driver's ends of two socket pairs for its output (SCM_RIGHTS):
one handshake per rank instead of three, which a launch of many ranks on few cores feels.

:class:`RankConnections` is the part of :class:`~nbaccel.launch.driver.group.WorkerGroup` that
does it.
"""

from __future__ import annotations

import os
import selectors
import socket
import time
from typing import Any

from nbaccel.launch.driver.lines import StreamLines
from nbaccel.launch.driver.rank_ends import EVENTS, OUTPUT
from nbaccel.launch.driver.rank_state import RankState
from nbaccel.launch.wire.channel import AuthenticationFailed, Connection, Handshake, Listener
from nbaccel.launch.wire.protocol import Stream

__all__ = ["HANDSHAKE", "RankConnections"]

# what a ready selector key carries for a connection still proving the secret
HANDSHAKE = "handshake"
_OUTPUT_STREAMS = (Stream.STDOUT.value, Stream.STDERR.value)


class RankConnections:
    """Accepting and authenticating the ranks' connections, for a group holding a
    ``_listener``, a ``_selector``, its ``_by_rank`` states and a ``renderer``."""

    _listener: Listener | None
    _selector: selectors.BaseSelector
    _by_rank: dict[int, RankState]
    _launch_id: str
    _handshakes: set[Handshake]
    _outputs: dict[Connection, tuple[RankState, str]]
    renderer: Any

    def _start_handshake(self) -> None:
        try:
            handshake = self._listener.start_handshake()
        except OSError:
            return
        self._selector.register(handshake, selectors.EVENT_READ, (HANDSHAKE, None, None))
        self._handshakes.add(handshake)

    def _expire_handshakes(self) -> None:
        now = time.monotonic()
        for handshake in [h for h in self._handshakes if h.deadline < now]:
            self._drop_handshake(handshake)
            handshake.close()
            self.renderer.notice("dropped a connection that did not authenticate in time")

    def _drop_handshake(self, handshake: Handshake) -> None:
        self._handshakes.discard(handshake)
        self._selector.unregister(handshake)

    def _accept(self, handshake: Handshake) -> None:
        try:
            conn = handshake.advance()
        except AuthenticationFailed:
            self._drop_handshake(handshake)
            self.renderer.notice("refused a connection that failed authentication")
            return
        if conn is None:
            return
        self._drop_handshake(handshake)
        header = conn.header
        state = self._by_rank.get(header.get("rank"))
        if state is None or header.get("launch") != self._launch_id:
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
        self._outputs[conn] = (state, stream)
