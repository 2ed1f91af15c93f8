"""Authenticated sockets between the driver (notebook kernel) and its workers.

The driver listens on a Unix socket inside a private (0700) directory; when that is impossible it
binds TCP on 127.0.0.1. Every connection runs a mutual HMAC-SHA256 challenge with the launch's
random secret *before* a single byte is unpickled, so another local user (or a web page poking at
localhost) cannot inject pickles, which would be remote code execution.

After the handshake a connection is either an *event* stream (length-prefixed pickles) or a raw
*output* stream (a worker's fd 1 or fd 2, read as bytes).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import pickle
import re
import select
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nbaccel.launch.wire.pickling import dumps_message

__all__ = [
    "INCOMPLETE",
    "AuthenticationFailed",
    "Connection",
    "Handshake",
    "Listener",
    "connect",
    "new_secret",
]

_NONCE = 32
_DIGEST = 32
_HANDSHAKE_TIMEOUT = 10.0
_MAX_FDS = 4  # descriptors a header may carry (a rank's stdout and stderr)
_FRAME = struct.Struct("!Q")
_READ_SIZE = 1 << 16  # one read of an event stream: every message a rank wrote at once
_LARGEST_READ = 1 << 24  # one read of a large message


class AuthenticationFailed(ConnectionError):
    """The peer did not prove it knows the launch secret."""


def new_secret() -> bytes:
    """A fresh per-session secret (never printed, never logged)."""
    return os.urandom(32)


def _mac(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, role + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks, remaining = [], size
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _close_all(fds: list[int]) -> None:
    """Close (and forget) descriptors received from a peer."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


def encode(messages: list[Any]) -> bytes:
    """``messages`` as the frames :meth:`Connection.recv` reads, one after the other."""
    frames = []
    for message in messages:
        data = dumps_message(message)
        frames += (_FRAME.pack(len(data)), data)
    return b"".join(frames)


class Connection:
    """One authenticated stream; ``send``/``recv`` frame pickles, ``fileno`` feeds selectors."""

    def __init__(
        self, sock: socket.socket, header: dict[str, Any] | None = None, fds: Sequence[int] = ()
    ) -> None:
        self.sock = sock
        self.header = header or {}
        #: descriptors the peer passed with its header (Unix sockets), the receiver's to close
        self.fds = list(fds)
        self._buffer = bytearray()  # bytes read past the last whole message

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: Any) -> None:
        self.sock.sendall(encode([message]))

    def send_many(self, messages: list[Any]) -> None:
        """Send ``messages`` in one write (one wake-up of the reader instead of several)."""
        self.sock.sendall(encode(messages))

    def send_encoded(self, frames: bytes) -> None:
        """Send what :func:`encode` made (one message pickled once for many connections)."""
        self.sock.sendall(frames)

    def recv(self) -> Any:
        """The next message; blocks until it is whole. One ``recv`` call takes whatever the
        socket holds, so messages sent in one write cost one system call to read (see
        :meth:`buffered`)."""
        if not self._buffer:
            message = self._read_whole()
            if message is not INCOMPLETE:
                return message
        while True:
            frame = self._take_frame()
            if frame is not None:
                return pickle.loads(frame)
            chunk = self.sock.recv(self._wanted())
            if not chunk:
                raise EOFError("connection closed")
            self._buffer += chunk

    def recv_ready(self) -> Any:
        """The next message if it is whole after at most one read (call it when a selector
        says the socket is readable), else :data:`INCOMPLETE`. A reader serving many
        connections uses it: a large message arriving in pieces (through a host agent's
        tunnel, which paces each connection) must not hold the reader while the pieces it
        waits for sit behind the other connections' bytes."""
        if not self._buffer:
            return self._read_whole()
        frame = self._take_frame()
        if frame is None:
            chunk = self.sock.recv(self._wanted())
            if not chunk:
                raise EOFError("connection closed")
            self._buffer += chunk
            frame = self._take_frame()
            if frame is None:
                return INCOMPLETE
        return pickle.loads(frame)

    def _read_whole(self) -> Any:
        """With nothing buffered: one read; the message when it brought exactly one whole
        message (a call, an outcome: most reads), unpickled in place, else INCOMPLETE with what
        it brought kept in the buffer."""
        chunk = self.sock.recv(_READ_SIZE)
        if not chunk:
            raise EOFError("connection closed")
        if len(chunk) > _FRAME.size and _FRAME.unpack_from(chunk)[0] == len(chunk) - _FRAME.size:
            return pickle.loads(memoryview(chunk)[_FRAME.size :])
        self._buffer += chunk
        frame = self._take_frame()
        return INCOMPLETE if frame is None else pickle.loads(frame)

    def buffered(self) -> bool:
        """True when a whole message is already read from the socket: a selector will not say
        so, so a reader woken by it calls :meth:`recv` until this is False."""
        if not self._buffer:
            return False
        end = self._frame_end()
        return end is not None and len(self._buffer) >= end

    def _frame_end(self) -> int | None:
        """Where the first message in the buffer ends (None: its length is not read yet)."""
        if len(self._buffer) < _FRAME.size:
            return None
        return _FRAME.size + _FRAME.unpack_from(self._buffer)[0]

    def _wanted(self) -> int:
        """How much to ask the socket for: what the message being read still lacks (a large
        result arrives in few reads), at least ``_READ_SIZE``."""
        end = self._frame_end()
        lacking = 0 if end is None else end - len(self._buffer)
        return min(max(lacking, _READ_SIZE), _LARGEST_READ)

    def _take_frame(self) -> bytes | None:
        end = self._frame_end()
        if end is None or len(self._buffer) < end:
            return None
        frame = bytes(memoryview(self._buffer)[_FRAME.size : end])
        del self._buffer[:end]
        return frame

    def close(self) -> None:
        _close_all(self.fds)  # passed to this end and never taken over
        try:
            self.sock.close()
        except OSError:
            pass


#: what :meth:`Connection.recv_ready` returns while a message is not whole yet
INCOMPLETE = object()


@dataclass
class Address:
    family: str  # "unix" | "tcp"
    location: str | tuple[str, int]
    #: a local entrance that relays bytes to a driver elsewhere (a host's agent): descriptors
    #: passed over it would not reach the driver
    relayed: bool = False

    @property
    def driver_on_this_host(self) -> bool:
        """The driver itself listens here: it can take descriptors and map this host's shared
        files. Over TCP, or through a relay, it may be on another host."""
        return self.family == "unix" and not self.relayed


class _Sweeps:
    """The temp folders this process has swept of stale private folders already."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._roots: set[str] = set()

    def first(self, root: str) -> bool:
        """True the first time ``root`` is asked for (it is then noted as swept)."""
        with self._lock:
            new = root not in self._roots
            self._roots.add(root)
            return new


_sweeps = _Sweeps()
_PRIVATE_DIR = re.compile(r"^nbaccel-(\d+)-")
#: longest temp folder that leaves room for ``/nbaccel-<pid>-<random>/channel`` in a socket path
_LONGEST_ROOT = 64


def _private_dir() -> str:
    """A fresh 0700 directory ``nbaccel-<pid>-*`` in the temp folder.

    The first one a process makes also removes those left by processes of this user that no
    longer exist (a kernel killed with SIGKILL never runs its cleanup).
    """
    root = tempfile.gettempdir()
    if len(root) > _LONGEST_ROOT and os.path.isdir("/tmp"):
        root = "/tmp"  # a Unix socket path must fit in ~104 bytes
    if _sweeps.first(root):
        _sweep_stale_dirs(root)
    return tempfile.mkdtemp(prefix=f"nbaccel-{os.getpid()}-", dir=root)  # 0700


def _sweep_stale_dirs(root: str) -> None:
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        match = _PRIVATE_DIR.match(name)
        if match is None:
            continue
        path = os.path.join(root, name)
        try:
            if os.lstat(path).st_uid != os.getuid() or not os.path.isdir(path):
                continue
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


def readable(objects: list[Any], timeout: float = 0.0) -> list[Any]:
    """Those of ``objects`` (anything with ``fileno()``) that have data or EOF waiting.

    ``poll``, not ``select``: a launch of hundreds of ranks holds descriptors above 1024,
    which ``select`` cannot watch."""
    if not objects:
        return []
    poller = select.poll()
    by_fd = {}
    for obj in objects:
        fd = obj.fileno()
        by_fd[fd] = obj
        poller.register(fd, select.POLLIN)
    return [by_fd[fd] for fd, _ in poller.poll(max(timeout, 0.0) * 1000)]


class Handshake:
    """One accepted connection being authenticated without blocking the driver.

    A silent or slow peer (any local process may connect) must not stall the ranks' output:
    the driver calls :meth:`advance` whenever the socket is readable, and drops handshakes past
    their ``deadline``. Nothing is unpickled before the peer proved the secret.

    The worker speaks first, so that it waits on the driver once, not twice (on 2 cores each
    wait is a turn of the scheduler while 8 ranks start): worker -> its nonce; driver -> its
    nonce and its proof over the worker's; worker -> its proof over the driver's, then at once
    the header (see :func:`connect`).
    """

    def __init__(self, sock: socket.socket, secret: bytes) -> None:
        self.sock = sock
        self._secret = secret
        self._nonce = os.urandom(_NONCE)
        self._buffer = bytearray()
        self._challenged = False  # the worker's nonce arrived, and the driver's proof left
        self._proved = False
        self._fds: list[int] = []  # passed with the header (SCM_RIGHTS), Unix sockets only
        self.deadline = time.monotonic() + _HANDSHAKE_TIMEOUT
        sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        _close_all(self._fds)
        try:
            self.sock.close()
        except OSError:
            pass

    def advance(self) -> Connection | None:
        """Read what arrived; the authenticated connection once the handshake is complete.

        Raises AuthenticationFailed (and closes the socket) on a wrong proof or a closed peer.
        """
        try:
            return self._advance()
        except AuthenticationFailed:
            self.close()
            raise
        except (OSError, ValueError, struct.error) as exc:
            self.close()
            raise AuthenticationFailed(f"handshake failed: {type(exc).__name__}") from None

    def _needed(self) -> int:
        """Bytes still to read for the current step (never more: what follows the header is
        the stream itself and belongs to the connection)."""
        if not self._challenged:
            return _NONCE - len(self._buffer)
        if not self._proved:
            return _DIGEST - len(self._buffer)
        if len(self._buffer) < 4:
            return 4 - len(self._buffer)
        (size,) = struct.unpack("!I", self._buffer[:4])
        if not 0 < size <= 1 << 16:
            raise AuthenticationFailed(f"handshake failed: a header of {size} bytes")
        return 4 + size - len(self._buffer)

    def _advance(self) -> Connection | None:
        while True:
            try:
                data = self._receive(self._needed())
            except BlockingIOError:
                return None
            if not data:
                raise AuthenticationFailed("handshake failed: the peer closed the connection")
            self._buffer.extend(data)
            if self._needed():
                continue
            if not self._challenged:
                peer_nonce = bytes(self._buffer)
                self._buffer.clear()
                self._challenged = True
                self.sock.settimeout(1.0)  # 64 bytes into a fresh socket's empty buffer
                self.sock.sendall(self._nonce + _mac(self._secret, b"driver", peer_nonce))
                self.sock.setblocking(False)
                continue
            if not self._proved:
                if not hmac.compare_digest(
                    bytes(self._buffer), _mac(self._secret, b"worker", self._nonce)
                ):
                    raise AuthenticationFailed("a connection failed the nbaccel handshake")
                self._buffer.clear()
                self._proved = True
                continue
            if len(self._buffer) == 4:
                continue  # the size is known; now the header itself
            header = json.loads(bytes(self._buffer[4:]))
            self.sock.setblocking(True)
            fds, self._fds = self._fds, []
            return Connection(self.sock, header, fds)

    def _receive(self, size: int) -> bytes:
        """``size`` bytes at most; after the proof, on a Unix socket, with any descriptors the
        peer attached to its header (they are only ever taken from an authenticated peer)."""
        if not self._proved or self.sock.family != getattr(socket, "AF_UNIX", None):
            return self.sock.recv(size)
        data, fds, _, _ = socket.recv_fds(self.sock, size, _MAX_FDS)
        self._fds.extend(fds)
        return data


class Listener:
    """Accepts worker connections that prove knowledge of ``secret``.

    Binds a Unix socket in a fresh 0700 directory by default; ``host`` (multi-node) binds TCP.
    """

    def __init__(self, secret: bytes, host: str | None = None, backlog: int = 256) -> None:
        self.secret = secret
        self._dir: str | None = None
        if host is None and hasattr(socket, "AF_UNIX"):
            self._dir = _private_dir()
            path = os.path.join(self._dir, "channel")
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.bind(path)
            os.chmod(path, 0o600)
            self.address = Address("unix", path)
        else:
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.sock.bind((host or "127.0.0.1", 0))
            self.address = Address("tcp", self.sock.getsockname()[:2])
        # every rank connects three streams at once: the backlog must hold them all
        self.sock.listen(max(256, backlog))

    def fileno(self) -> int:
        return self.sock.fileno()

    def private_path(self, name: str) -> str:
        """A path inside this listener's private (0700) directory, removed by ``close``."""
        if self._dir is None:
            self._dir = _private_dir()
        return os.path.join(self._dir, name)

    def start_handshake(self) -> Handshake:
        """Accept one connection; its authentication then advances as its bytes arrive."""
        sock, _ = self.sock.accept()
        return Handshake(sock, self.secret)

    def accept(self) -> Connection:
        """Accept one connection and authenticate it (blocking, up to the handshake timeout);
        raises AuthenticationFailed otherwise."""
        handshake = self.start_handshake()
        while True:
            wait = handshake.deadline - time.monotonic()
            if wait <= 0 or not readable([handshake], wait):
                handshake.close()
                raise AuthenticationFailed("handshake failed: timed out")
            conn = handshake.advance()
            if conn is not None:
                return conn

    def close(self) -> None:
        try:
            self.sock.close()
        finally:
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None


def connect(
    address: Address, secret: bytes, header: dict[str, Any], fds: Sequence[int] = ()
) -> Connection:
    """Connect to the driver, check its proof of the secret, prove it too, send ``header``
    (with ``fds`` attached, on a Unix socket: descriptors the driver takes over). One wait on
    the driver (see :class:`Handshake`)."""
    family = socket.AF_UNIX if address.family == "unix" else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(_HANDSHAKE_TIMEOUT)
    sock.connect(address.location)
    my_nonce = os.urandom(_NONCE)
    sock.sendall(my_nonce)
    reply = _recv_exact(sock, _NONCE + _DIGEST)
    driver_nonce, proof = reply[:_NONCE], reply[_NONCE:]
    if not hmac.compare_digest(proof, _mac(secret, b"driver", my_nonce)):
        sock.close()
        raise AuthenticationFailed("the driver did not prove the launch secret")
    # the proof alone, the header in a send of its own: descriptors attached to the header
    # must not ride on bytes the driver reads before it trusts this peer
    sock.sendall(_mac(secret, b"worker", driver_nonce))
    data = json.dumps(header).encode()
    framed = struct.pack("!I", len(data)) + data
    sent = socket.send_fds(sock, [framed], list(fds)) if fds else 0
    sock.sendall(framed[sent:])
    sock.settimeout(None)
    return Connection(sock, header)
