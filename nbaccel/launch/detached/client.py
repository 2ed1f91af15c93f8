"""Talking to this user's supervisor: start it when none runs, send it one request.

:func:`request` connects to the supervisor's socket (starting the supervisor first when none
answers), sends one JSON line, returns the JSON answer, and raises RuntimeError with the
supervisor's error when it refused.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from nbaccel.launch.detached.paths import runs_root, socket_path

__all__ = ["request", "start_supervisor", "supervisor_pid"]

_CONNECT_TRIES = 50


def _send(path: Path, message: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(str(path))
        conn.sendall(json.dumps(message).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
    if not data:
        raise ConnectionResetError("the supervisor closed the connection without answering")
    return json.loads(data)


# The supervisor needs the standard library and this package's detached modules only: it is
# started without running nbaccel's own __init__ (which imports torch and the whole API), so it
# starts in a fraction of a second and stays small while it waits.
_ENTRY = """
import sys, types
package = types.ModuleType("nbaccel")
package.__path__ = [sys.argv[1]]
sys.modules["nbaccel"] = package
from nbaccel.launch.detached.supervisor import main
sys.exit(main(sys.argv[2:]))
"""


def start_supervisor(root: Path) -> None:
    """Start the supervisor of ``root`` (it detaches itself; this returns once it listens, or
    once another one already serves ``root``)."""
    package = str(Path(__file__).resolve().parents[2])  # the nbaccel package's folder
    log = os.open(root / "supervisor.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        subprocess.run(
            [sys.executable, "-c", _ENTRY, package, str(root)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            cwd=str(root),
            start_new_session=True,
            check=True,
            timeout=60,
        )
    finally:
        os.close(log)


def request(op: str, root: Path | None = None, start: bool = True, **fields: Any) -> dict:
    """Send ``{"op": op, **fields}`` to the supervisor of ``root`` (default: this user's);
    its answer. ``start``: start the supervisor when none answers (else ConnectionError)."""
    root = runs_root() if root is None else root
    path = socket_path(root)
    started = False
    for _ in range(_CONNECT_TRIES):
        try:
            answer = _send(path, {"op": op, **fields})
        except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError):
            if not start:
                raise ConnectionError(f"no supervisor serves {root}") from None
            if not started:
                start_supervisor(root)
                started = True
            else:
                time.sleep(0.1)
            continue
        if not answer.get("ok"):
            raise RuntimeError(f"the runs supervisor refused {op!r}: {answer.get('error')}")
        return answer
    raise ConnectionError(f"the runs supervisor of {root} does not answer on {path}")


def supervisor_pid(root: Path | None = None) -> int | None:
    """The pid of the supervisor serving ``root``, or None when none does."""
    try:
        return int(request("ping", root, start=False)["pid"])
    except (ConnectionError, OSError):
        return None
