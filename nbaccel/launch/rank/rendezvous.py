"""A rank's ``env://`` rendezvous that does not sleep on torch's connection retry.

``dist.init_process_group()`` (``env://``, the default) has rank 0 open the store (torch's
TCPStore) on ``MASTER_ADDR:MASTER_PORT`` and every other rank connect to it. A rank that comes
first finds nothing listening, and torch's client waits half a second or more (an exponential
backoff with jitter, not configurable) before it tries again. Ranks of one launch reach that
call at nearly the same moment, so which comes first is chance: ranks on other hosts (forked by
their host's agent, at their own pace) lose that half second on most launches.

:func:`install` wraps the ``env`` rendezvous in the rank's process: a rank other than 0 first
waits for the port to accept a connection, trying every few milliseconds (a connection that
closes without a word is nothing to the store), then connects as torch always does. Rank 0,
the store, its keys and every other rendezvous are untouched. Where torch keeps its handlers
elsewhere (another version), nothing is installed and torch's own behaviour stays.
"""

from __future__ import annotations

import importlib
import os
import socket
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["install", "wait_listening"]

#: seconds between two tries of the store's port
_TRY_EVERY = 0.005


def wait_listening(host: str, port: int, timeout: float) -> bool:
    """Until ``host:port`` accepts a TCP connection (closed at once); False after ``timeout``
    seconds, or when the address cannot be resolved (torch then says why)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(1.0, timeout))).close()
            return True
        except socket.gaierror:
            return False
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_TRY_EVERY)


def _rank(url: str) -> int | None:
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlparse(url).query))
    value = query.get("rank", os.environ.get("RANK"))
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def _patient(original: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    def env_rendezvous(url: str, timeout: Any = None, **kwargs: Any) -> Iterator[Any]:
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
        if _rank(url) not in (0, None) and host and port.isdigit():
            seconds = timeout.total_seconds() if timeout is not None else 60.0
            wait_listening(host, int(port), seconds)
        if timeout is None:
            return original(url, **kwargs)
        return original(url, timeout=timeout, **kwargs)

    env_rendezvous.nbaccel_patient = True  # type: ignore[attr-defined]
    return env_rendezvous


def install() -> bool:
    """Wrap this process's ``env://`` rendezvous (once); False where torch's handlers are not
    where this version of nbaccel knows them."""
    try:  # the module: ``torch.distributed.rendezvous`` is also the name of its function
        rendezvous = importlib.import_module("torch.distributed.rendezvous")
    except ImportError:
        return False
    handlers = getattr(rendezvous, "_rendezvous_handlers", None)
    original = handlers.get("env") if isinstance(handlers, dict) else None
    if original is None or getattr(original, "nbaccel_patient", False):
        return False
    handlers["env"] = _patient(original)
    return True
