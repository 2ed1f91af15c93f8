"""TCP ports on this host: a free one to use, one asked for that must be free, one in use."""

from __future__ import annotations

import socket

__all__ = ["check_port", "free_port", "is_port_in_use"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (``""``: on every interface)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port(port: int, host: str) -> None:
    """ValueError naming the fix when ``port`` is already taken on this machine."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host if host in ("127.0.0.1", "localhost") else "", port))
        except OSError:
            raise ValueError(
                f"use_port={port} is already in use on this machine (perhaps by an earlier "
                "launch that is still running); pass use_port=None to let nbaccel pick a free "
                "port, or choose another one."
            ) from None


def is_port_in_use(port: int | None = None) -> bool:
    """True when something listens on ``localhost:port`` (default 29500, torch's usual port)."""
    port = port or 29500
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        return probe.connect_ex(("localhost", port)) == 0
