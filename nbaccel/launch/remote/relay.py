"""One tunnelled connection's local end: a non-blocking socket with a queue of bytes to write.

The hub (kernel side) and the agent (host side) each run one loop for many connections; a
reader that is slow to drain its socket (a rank busy computing, a kernel busy rendering) must not
stall the loop, and with it every other connection and the heartbeats. So writes are queued and
flushed as the socket accepts them.

Relays may share one queue (:class:`Ordered`): then bytes reach their sockets in the order they
were fed, across the relays. The hub feeds all of one agent's connections through one queue, so
what a rank printed before its result is in the kernel's stdout socket before the result is in
its events socket: a call's end then finds all of its output (see ``WorkerGroup.end_call``).
"""

from __future__ import annotations

import socket
from collections import deque

__all__ = ["Ordered", "Relay"]

_CHUNK = 1 << 16
_READ_AT_ONCE = 1 << 22  # bytes one read takes at most: a rank printing without pause cannot
# hold the loop, and it is far above a socket's buffer (what was written before a poll)


class Ordered:
    """A queue of ``(relay, bytes)`` written strictly in order: a relay whose socket is full
    holds back what was fed after it, to every relay of the queue."""

    def __init__(self) -> None:
        self.items: deque[tuple[Relay, memoryview]] = deque()
        self.size = 0  # bytes queued

    def add(self, relay: Relay, data: bytes) -> None:
        self.items.append((relay, memoryview(data)))
        self.size += len(data)
        relay.queued += 1
        self.flush()

    def head(self) -> Relay | None:
        return self.items[0][0] if self.items else None

    def flush(self) -> None:
        """Write from the front while the sockets accept it."""
        items = self.items
        while items:
            relay, data = items[0]
            if relay.closed:
                self.size -= len(items.popleft()[1])
                continue
            try:
                sent = relay.sock.send(data)
            except BlockingIOError:
                return
            except OSError:
                relay.close()
                continue
            self.size -= sent
            if sent < len(data):
                items[0] = (relay, data[sent:])
                return  # that socket is full: the rest waits for it
            items.popleft()
            relay.queued -= 1
            if relay.ending and not relay.queued:
                relay.close()

    def drop(self, relay: Relay) -> None:
        """Forget what is queued for ``relay`` (closed)."""
        if any(item[0] is relay for item in self.items):
            kept = [item for item in self.items if item[0] is not relay]
            self.size = sum(len(data) for _, data in kept)
            self.items.clear()
            self.items.extend(kept)
        relay.queued = 0


class Relay:
    """A socket, its pending output (its own queue, or one it shares), and whether it reads."""

    def __init__(self, sock: socket.socket, order: Ordered | None = None) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._order = order if order is not None else Ordered()
        self.queued = 0  # pieces of this relay's data in the queue
        self.closed = False
        self.ending = False  # close as soon as its queued data is written

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def wants_write(self) -> bool:
        """Its socket must become writable for the queue to move on."""
        return self._order.head() is self

    def feed(self, data: bytes) -> None:
        """Queue ``data``; it is written by :meth:`flush`, after everything fed before it."""
        if data and not self.closed:
            self._order.add(self, data)

    def flush(self) -> None:
        """Write what the sockets accept now; a broken peer closes its relay."""
        self._order.flush()

    def read(self, limit: int = _READ_AT_ONCE) -> bytes | None:
        """What arrived, up to what was there when the loop last looked (more when it keeps
        coming), at most ``limit`` bytes: bytes, ``b""`` when the peer closed (or broke), None
        when nothing yet. All of it, not one chunk: what a rank wrote before a message on
        another of its connections must leave first."""
        pieces: list[bytes] = []
        size = 0
        while size < limit:
            try:
                piece = self.sock.recv(min(_CHUNK, limit - size))
            except BlockingIOError:
                break
            except OSError:
                piece = b""
            if not piece:
                if not pieces:
                    return b""
                break  # the close is seen on the next read
            pieces.append(piece)
            size += len(piece)
        if not pieces:
            return None
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def finish(self) -> None:
        """Close once everything queued is written (the other end closed after its data)."""
        self.ending = True
        if not self.queued:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._order.drop(self)
            try:
                self.sock.close()
            except OSError:
                pass
