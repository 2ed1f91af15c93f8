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

__all__ = ["Session", "agent_folder", "directory_error", "machine_id", "shm_dir"]

_FOLDER_PREFIX = "nbaccel-agent-"


def agent_folder() -> str:
    """A new private folder (0700, in the temp dir) for this agent's launches.

    An agent killed outright (SIGKILL) cannot remove its folder; the next agent on the host
    removes such folders first: only its user's, only empty ones, only where the agent's
    process is gone. Where another PID namespace shares this temp dir, a live agent's empty
    folder may be taken for such: :class:`Session` makes it again for that agent's next launch.
    """
    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            pid = name[len(_FOLDER_PREFIX) :].split("-", 1)[0]
            if not (name.startswith(_FOLDER_PREFIX) and pid.isdigit()) or _alive(int(pid)):
                continue
            path = os.path.join(root, name)
            with contextlib.suppress(OSError):
                if os.lstat(path).st_uid == os.getuid():
                    os.rmdir(path)  # refused unless empty
    return tempfile.mkdtemp(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process
    return True


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
        os.makedirs(os.path.dirname(private), mode=0o700, exist_ok=True)  # see agent_folder
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
