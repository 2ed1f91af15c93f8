"""One launch's share of a host, as its agent keeps it, and what the agent tells of its host.

A :class:`Session` is what a launch holds on a host between ``BEGIN`` and ``END``: its ranks,
the entrance of its channel (a Unix socket the agent tunnels to the kernel), the shared tensors
written to the host's /dev/shm.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import tempfile

from nbaccel.launch.host.processes import WorkerProcess

__all__ = ["Session", "directory_error", "machine_id", "shm_dir"]


def machine_id() -> str:
    """What tells this machine apart: its kernel's boot id, the same in every container or
    network namespace of it (hosts that share their cores), else its host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return handle.read().strip()
    except OSError:
        return socket.gethostname()


def shm_dir() -> str:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def directory_error(path: str) -> str | None:
    """Why ``path`` cannot be a working directory here (None: it can)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    return None


class Session:
    """One launch's share of this host: its ranks, its channel entrance, its files."""

    def __init__(self, lid: str, private: str) -> None:
        self.lid = lid
        self.private = private
        os.makedirs(private, mode=0o700)
        self.entrance = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.entrance_path = os.path.join(private, "channel")
        self.entrance.bind(self.entrance_path)
        os.chmod(self.entrance_path, 0o600)
        self.entrance.listen(256)
        self.ranks: dict[int, WorkerProcess] = {}
        self.reported: set[int] = set()
        self.files: dict[str, int] = {}  # path -> fd holding its lock (see transport's sweep)

    def unlink(self, path: str) -> None:
        """Remove one of the launch's shared files (every rank mapped it)."""
        if path in self.files:
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.close(self.files.pop(path))

    def close(self) -> list[WorkerProcess]:
        """Kill what is left of the ranks; remove the entrance, the files, the folder. The
        killed ranks come back, to be polled until the fork server reports them gone."""
        killed = [p for p in self.ranks.values() if p.poll() is None]
        for process in killed:
            process.signal_tree(signal.SIGKILL)
        self.entrance.close()
        for path in list(self.files):
            self.unlink(path)
        shutil.rmtree(self.private, ignore_errors=True)
        return killed
