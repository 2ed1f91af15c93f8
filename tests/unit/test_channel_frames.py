"""The event stream's framing: messages written together are read with one system call, and a
message split across writes (or arriving a byte at a time) comes out whole."""

from __future__ import annotations

import socket
import threading

import pytest

from nbaccel.launch.wire.channel import INCOMPLETE, Connection, encode
from nbaccel.launch.wire.protocol import Message


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


def test_a_reader_of_many_connections_takes_a_large_message_in_pieces_without_waiting():
    """``recv_ready`` reads once and returns: a 6 MB message whose bytes arrive in pieces (as
    through a host agent's paced tunnel) is handed over only when whole, and the reader is
    never stuck in the middle of it while another connection has bytes for it."""
    a, b = socket.socketpair()
    other_a, other_b = socket.socketpair()
    reader = Connection(_CountingSocket(a))
    payload = bytes(range(256)) * 24_000  # 6 MB
    frames = encode([(Message.RESULT, 7, payload)])
    pieces = [frames[i : i + 100_000] for i in range(0, len(frames), 100_000)]
    seen_other = []
    for piece in pieces[:-1]:
        b.sendall(piece)
        other_b.sendall(b"x")  # the other connection, served between the pieces
        while _readable(a):  # what a selector does: read while the socket says readable
            assert reader.recv_ready() is INCOMPLETE
        seen_other.append(other_a.recv(1))
    b.sendall(pieces[-1])
    message = INCOMPLETE
    while message is INCOMPLETE and _readable(a):
        message = reader.recv_ready()
    assert message == (Message.RESULT, 7, payload)
    assert seen_other == [b"x"] * (len(pieces) - 1)
    assert not reader.buffered()
    b.close()
    with pytest.raises(EOFError):
        reader.recv_ready()


def _readable(sock: socket.socket) -> bool:
    import select

    return bool(select.select([sock], [], [], 0)[0])
