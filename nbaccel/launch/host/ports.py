"""Is a TCP port on this host already taken? (The launcher's own pick is ``plan.free_port``.)"""

from __future__ import annotations

import socket

__all__ = ["is_port_in_use"]


def is_port_in_use(port: int | None = None) -> bool:
    """True when something listens on ``localhost:port`` (default 29500, torch's usual port)."""
    port = port or 29500
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        return probe.connect_ex(("localhost", port)) == 0
