"""The event stream's framing: messages written together are read with one system call, and a
message split across writes (or arriving a byte at a time) comes out whole."""

from __future__ import annotations

import socket
import threading

import pytest

from nbaccel.launch.channel import Connection, encode
from nbaccel.launch.protocol import Message


class _CountingSocket:
    """A real socket whose ``recv`` calls are counted."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.reads = sock, 0

    def recv(self, size: int) -> bytes:
        self.reads += 1
        return self.sock.recv(size)

    def fileno(self) -> int:
        return self.sock.fileno()


def test_messages_sent_in_one_write_are_read_with_one_call():
    a, b = socket.socketpair()
    with a, b:
        reader = _CountingSocket(b)
        conn = Connection(reader)  # type: ignore[arg-type]
        Connection(a).send_many([(Message.EVENT, "memory", {"rss": 1}), (Message.RESULT, 4, b"v")])
        assert conn.recv() == (Message.EVENT, "memory", {"rss": 1})
        assert conn.buffered()  # the outcome came with it: a selector would not say so
        assert conn.recv() == (Message.RESULT, 4, b"v")
        assert not conn.buffered()
        assert reader.reads == 1


def test_a_message_arriving_a_byte_at_a_time_comes_out_whole():
    a, b = socket.socketpair()
    with a, b:
        conn = Connection(b)
        frames = encode([(Message.RESULT, 1, b"x" * 100_000), (Message.READY,)])

        def trickle() -> None:
            a.sendall(frames[:3])
            for start in range(3, 20):
                a.sendall(frames[start : start + 1])
            a.sendall(frames[20:])

        writer = threading.Thread(target=trickle)
        writer.start()
        assert conn.recv() == (Message.RESULT, 1, b"x" * 100_000)
        assert conn.recv() == (Message.READY,)
        writer.join()
        a.close()
        with pytest.raises(EOFError):
            conn.recv()
