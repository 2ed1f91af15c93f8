"""One tunnelled connection's local end: a non-blocking socket with a queue of bytes to write.

The hub (kernel side) and the agent (host side) each run one loop for many connections; a
reader that is slow to drain its socket (a rank busy computing, a kernel busy rendering) must not
stall the loop, and with it every other connection and the heartbeats. So writes are queued and
flushed as the socket accepts them.
"""

from __future__ import annotations

import socket
from collections import deque

__all__ = ["Relay"]

_CHUNK = 1 << 16


class Relay:
    """A socket, its pending output, and whether it still reads."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._pending: deque[memoryview] = deque()
        self.closed = False
        self.ending = False  # close as soon as the queue is empty

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def wants_write(self) -> bool:
        return bool(self._pending)

    def feed(self, data: bytes) -> None:
        """Queue ``data``; it is written by :meth:`flush`."""
        if data and not self.closed:
            self._pending.append(memoryview(data))
            self.flush()

    def flush(self) -> None:
        """Write what the socket accepts now; a broken peer closes the relay."""
        while self._pending and not self.closed:
            head = self._pending[0]
            try:
                sent = self.sock.send(head)
            except BlockingIOError:
                return
            except OSError:
                self.close()
                return
            if sent == len(head):
                self._pending.popleft()
            else:
                self._pending[0] = head[sent:]
        if self.ending and not self._pending:
            self.close()

    def read(self) -> bytes | None:
        """What arrived: bytes, ``b""`` when the peer closed (or broke), None when nothing yet."""
        try:
            return self.sock.recv(_CHUNK)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def finish(self) -> None:
        """Close once everything queued is written (the other end closed after its data)."""
        self.ending = True
        if not self._pending:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._pending.clear()
            try:
                self.sock.close()
            except OSError:
                pass
