"""A local rank opens one authenticated connection; its stdout and stderr travel as socket
pairs passed over it (SCM_RIGHTS). Output, C-level writes included, keeps its rank and stream;
descriptors come only from an authenticated peer, and only those announced are kept."""

from __future__ import annotations

import os
import socket
import threading

from recorder import Recorder

from nbaccel import notebook_launcher
from nbaccel.launch.driver.rank_connections import ConnectionTable
from nbaccel.launch.wire.channel import Listener, connect, new_secret


def _speak():
    import sys

    from nbaccel import PartialState

    rank = PartialState().process_index
    print(f"out {rank}")
    print(f"err {rank}", file=sys.stderr)
    os.write(1, f"c-out {rank}\n".encode())  # below Python: the descriptor itself
    os.write(2, f"c-err {rank}\n".encode())
    return rank


def test_one_connection_per_rank_and_every_stream_keeps_its_rank(monkeypatch):
    accepted = []
    original = ConnectionTable.start_handshake

    def counting(self):
        accepted.append(1)
        return original(self)

    monkeypatch.setattr(ConnectionTable, "start_handshake", counting)
    renderer = Recorder()
    assert notebook_launcher(_speak, num_processes=3, renderer=renderer) == [0, 1, 2]
    assert len(accepted) == 3
    for rank in range(3):
        assert (rank, "stdout", f"out {rank}") in renderer.lines
        assert (rank, "stderr", f"err {rank}") in renderer.lines
        assert (rank, "stdout", f"c-out {rank}") in renderer.lines
        assert (rank, "stderr", f"c-err {rank}") in renderer.lines


def _pass_over(listener, secret, header, fds):
    """A client connecting with ``fds`` attached to ``header``; (client, accepted connection)."""
    got = []
    thread = threading.Thread(target=lambda: got.append(listener.accept()))
    thread.start()
    client = connect(listener.address, secret, header, fds)
    thread.join(10)
    (conn,) = got
    return client, conn


def test_descriptors_arrive_with_an_authenticated_header():
    secret = new_secret()
    listener = Listener(secret)
    near, far = socket.socketpair()
    try:
        header = {"rank": 0, "carries": ["stdout"]}
        client, conn = _pass_over(listener, secret, header, [far.fileno()])
        assert conn.header["carries"] == ["stdout"] and len(conn.fds) == 1
        taken = socket.socket(fileno=conn.fds.pop())
        near.sendall(b"through the passed pair")
        assert taken.recv(100) == b"through the passed pair"
        taken.close()
        conn.close()
        client.close()
    finally:
        near.close()
        far.close()
        listener.close()


def test_descriptors_not_taken_over_are_closed_with_the_connection():
    secret = new_secret()
    listener = Listener(secret)
    read_end, write_end = os.pipe()
    try:
        client, conn = _pass_over(listener, secret, {"rank": 0}, [write_end])
        os.close(write_end)
        conn.close()  # the driver's copy of the write end goes: the pipe reaches its end
        assert os.read(read_end, 10) == b""
        assert conn.fds == []
        client.close()
    finally:
        os.close(read_end)
        listener.close()
