"""Authenticated sockets between the driver (notebook kernel) and its workers.

The driver listens on a Unix socket inside a private (0700) directory; when that is impossible it
binds TCP on 127.0.0.1. Every connection runs a mutual HMAC-SHA256 challenge with the launch's
random secret *before* a single byte is unpickled, so another local user (or a web page poking at
localhost) cannot inject pickles, which would be remote code execution.

After the handshake a connection is either an *event* stream (length-prefixed pickles) or a raw
*output* stream (a worker's fd 1 or fd 2, read as bytes).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pickle
import shutil
import socket
import struct
import tempfile
from dataclasses import dataclass
from typing import Any

import cloudpickle

__all__ = ["AuthenticationFailed", "Connection", "Listener", "connect", "new_secret"]

_NONCE = 32
_DIGEST = 32
_HANDSHAKE_TIMEOUT = 10.0
_FRAME = struct.Struct("!Q")


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


class Connection:
    """One authenticated stream; ``send``/``recv`` frame pickles, ``fileno`` feeds selectors."""

    def __init__(self, sock: socket.socket, header: dict[str, Any] | None = None) -> None:
        self.sock = sock
        self.header = header or {}

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: Any) -> None:
        data = cloudpickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self.sock.sendall(_FRAME.pack(len(data)) + data)

    def recv(self) -> Any:
        (size,) = _FRAME.unpack(_recv_exact(self.sock, _FRAME.size))
        return pickle.loads(_recv_exact(self.sock, size))

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


@dataclass
class Address:
    family: str  # "unix" | "tcp"
    location: str | tuple[str, int]


class Listener:
    """Accepts worker connections that prove knowledge of ``secret``.

    Binds a Unix socket in a fresh 0700 directory by default; ``host`` (multi-node) binds TCP.
    """

    def __init__(self, secret: bytes, host: str | None = None, backlog: int = 256) -> None:
        self.secret = secret
        self._dir: str | None = None
        if host is None and hasattr(socket, "AF_UNIX"):
            self._dir = tempfile.mkdtemp(prefix=f"nbaccel-{os.getpid()}-")
            os.chmod(self._dir, 0o700)
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
            self._dir = tempfile.mkdtemp(prefix=f"nbaccel-{os.getpid()}-")
        return os.path.join(self._dir, name)

    def accept(self) -> Connection:
        """Accept one connection and authenticate it; raises AuthenticationFailed otherwise."""
        sock, _ = self.sock.accept()
        sock.settimeout(_HANDSHAKE_TIMEOUT)
        try:
            nonce = os.urandom(_NONCE)
            sock.sendall(nonce)
            peer_nonce = _recv_exact(sock, _NONCE)
            proof = _recv_exact(sock, _DIGEST)
            if not hmac.compare_digest(proof, _mac(self.secret, b"worker", nonce)):
                raise AuthenticationFailed("a connection failed the nbaccel handshake")
            sock.sendall(_mac(self.secret, b"driver", peer_nonce))
            (size,) = struct.unpack("!I", _recv_exact(sock, 4))
            header = json.loads(_recv_exact(sock, min(size, 1 << 16)))
        except (OSError, EOFError, ValueError, struct.error) as exc:
            sock.close()
            raise AuthenticationFailed(f"handshake failed: {type(exc).__name__}") from None
        except AuthenticationFailed:
            sock.close()
            raise
        sock.settimeout(None)
        return Connection(sock, header)

    def close(self) -> None:
        try:
            self.sock.close()
        finally:
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None


def connect(address: Address, secret: bytes, header: dict[str, Any]) -> Connection:
    """Connect to the driver, prove the secret, check the driver's proof, send ``header``."""
    family = socket.AF_UNIX if address.family == "unix" else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(_HANDSHAKE_TIMEOUT)
    sock.connect(address.location)
    nonce = _recv_exact(sock, _NONCE)
    my_nonce = os.urandom(_NONCE)
    sock.sendall(my_nonce + _mac(secret, b"worker", nonce))
    if not hmac.compare_digest(_recv_exact(sock, _DIGEST), _mac(secret, b"driver", my_nonce)):
        sock.close()
        raise AuthenticationFailed("the driver did not prove the launch secret")
    data = json.dumps(header).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)
    sock.settimeout(None)
    return Connection(sock, header)
