"""The link between a kernel and a detached pool's host: a Unix socket only its user reaches.

The host listens on a socket of mode 0600 in its 0700 pool folder (under the 0700 runs root),
and each end checks the other's uid (``SO_PEERCRED``, as the supervisor does) before it reads
a byte: a peer of another user is refused unread, so nothing it sent is ever unpickled. After
that the two ends speak the launch engine's framed pickles
(:class:`~nbaccel.launch.wire.channel.Connection`).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from nbaccel.launch.detached.supervisor import peer_uid
from nbaccel.launch.wire.channel import Connection

__all__ = ["accept", "connect", "listen"]


def _same_user(sock: socket.socket) -> None:
    uid = peer_uid(sock)
    if uid is not None and uid != os.getuid():
        sock.close()
        raise PermissionError(f"the peer of this pool's socket is another user (uid {uid})")


def listen(path: Path) -> socket.socket:
    """A listening socket at ``path``, mode 0600 (a stale one there is replaced)."""
    if path.exists() or path.is_symlink():
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    listener.listen(8)
    return listener


def accept(listener: socket.socket) -> Connection:
    """The next connection, once its peer is known to be this user (else PermissionError)."""
    sock, _ = listener.accept()
    _same_user(sock)
    sock.settimeout(None)
    return Connection(sock)


def connect(path: Path, timeout: float = 10.0) -> Connection:
    """A connection to the host at ``path``, once the host is known to be this user."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        raise
    _same_user(sock)
    sock.settimeout(None)
    return Connection(sock)
