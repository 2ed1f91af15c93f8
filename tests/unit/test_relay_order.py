"""The relays of the cross-host tunnel (``launch/remote/relay.py``) on real socket pairs.

The hub feeds all of one agent's connections through one queue, so a rank's output reaches the
kernel before the result the rank sent after it, even when the kernel reads its output more
slowly than the host sends it; and a read takes everything that is there, not one chunk, so the
agent forwards a rank's output before a later message on another of its connections.
"""

from __future__ import annotations

import socket

from nbaccel.launch.remote.relay import Ordered, Relay


def _pair() -> tuple[socket.socket, socket.socket]:
    near, far = socket.socketpair()
    far.setblocking(False)
    return near, far


def _drain(sock: socket.socket) -> bytes:
    out = []
    while True:
        try:
            piece = sock.recv(1 << 16)
        except BlockingIOError:
            return b"".join(out)
        if not piece:
            return b"".join(out)
        out.append(piece)


def test_a_shared_queue_holds_later_bytes_behind_a_full_socket():
    order = Ordered()
    (out_near, out_far), (ev_near, ev_far) = _pair(), _pair()
    output, events = Relay(out_near, order), Relay(ev_near, order)
    flood = bytes(range(256)) * 40_000  # 10 MB: far more than a socket buffer holds
    output.feed(flood)
    assert output.wants_write and not events.wants_write  # the full socket is the queue's head
    events.feed(b"RESULT")
    assert _drain(ev_far) == b""  # the result waits behind the output fed before it
    received = b""
    while events.queued:
        received += _drain(out_far)
        output.flush()  # what the loop does when the output socket is writable again
    received += _drain(out_far)
    assert received == flood  # all of it, in order, before the result was written
    assert _drain(ev_far) == b"RESULT"
    assert not output.wants_write and not events.wants_write


def test_relays_with_their_own_queues_do_not_wait_for_each_other():
    (a_near, _a_far), (b_near, b_far) = _pair(), _pair()  # _a_far: open, never read
    a, b = Relay(a_near), Relay(b_near)
    a.feed(b"x" * 10_000_000)
    b.feed(b"independent")
    assert _drain(b_far) == b"independent"
    assert a.wants_write and not b.wants_write
    a.close()
    assert not a.wants_write and a.closed


def test_a_closed_relay_drops_only_its_own_bytes():
    order = Ordered()
    (a_near, a_far), (b_near, b_far) = _pair(), _pair()
    a, b = Relay(a_near, order), Relay(b_near, order)
    a.feed(b"y" * 10_000_000)  # blocks the queue
    b.feed(b"after")
    a_far.close()  # the reader of a is gone
    a.flush()  # the broken peer closes a; b's bytes move on
    assert a.closed and _drain(b_far) == b"after"


def test_finish_closes_once_its_queued_bytes_are_written():
    order = Ordered()
    (a_near, a_far), (b_near, b_far) = _pair(), _pair()
    a, b = Relay(a_near, order), Relay(b_near, order)
    a.feed(b"z" * 10_000_000)
    b.feed(b"last words")
    b.finish()  # the far end of b closed after its data: b closes once "last words" is out
    assert not b.closed
    while not b.closed:
        _drain(a_far)
        a.flush()
    assert _drain(b_far) == b"last words"


def test_a_read_takes_everything_that_is_there():
    near, far = socket.socketpair()
    relay = Relay(near)
    far.setblocking(False)
    sent = 0
    try:
        while True:
            sent += far.send(b"p" * 65536)
    except BlockingIOError:
        pass
    assert sent > 1 << 16  # more than one chunk is waiting
    assert relay.read(1000) == b"p" * 1000  # an agent's window allows no more than its room
    assert relay.read() == b"p" * (sent - 1000)
    assert relay.read() is None  # nothing more yet
    far.close()
    assert relay.read() == b""  # the peer closed
