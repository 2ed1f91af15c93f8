"""Where a user's detached runs live, made private to that user.

The run folders and the supervisor's socket live in one directory: ``$NBACCEL_RUNS_DIR``, else
``~/.nbaccel/runs``. It is created with mode 0700 and must belong to this user and be closed to
others; anything else is refused before a run starts, naming the fix. The socket goes beside
the folders, or, when that path is too long for a Unix socket, into a 0700 directory of this
user under the system's temporary directory.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["RUNS_DIR_VAR", "private_dir", "runs_root", "socket_path"]

RUNS_DIR_VAR = "NBACCEL_RUNS_DIR"
_SOCKET_NAME = "supervisor.sock"
_MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux, 104 on macOS


def private_dir(path: str | os.PathLike) -> Path:
    """``path`` as a directory only this user can enter (created 0700 when missing).

    Raises PermissionError naming the problem and the fix when it belongs to another user or
    others may read it."""
    path = Path(path).expanduser().absolute()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid():
        raise PermissionError(
            f"{path} belongs to another user (uid {info.st_uid}); detached runs need a "
            f"directory of your own: set {RUNS_DIR_VAR} to one."
        )
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def runs_root() -> Path:
    """The directory of this user's run folders (private; see the module docstring)."""
    chosen = os.environ.get(RUNS_DIR_VAR) or os.path.join("~", ".nbaccel", "runs")
    return private_dir(chosen)


def socket_path(root: Path, name: str = _SOCKET_NAME) -> Path:
    """The socket ``name`` of the folder ``root``: the supervisor's (for the runs under
    ``root``), or a detached pool's (in its folder)."""
    beside = root / name
    if len(os.fsencode(beside)) <= _MAX_SOCKET_PATH:
        return beside
    named = root if name == _SOCKET_NAME else beside  # the supervisor's as it always was
    tag = hashlib.sha256(os.fsencode(named)).hexdigest()[:12]
    short = private_dir(Path(tempfile.gettempdir()) / f"nbaccel-{os.getuid()}")
    return short / f"{tag}.sock"
