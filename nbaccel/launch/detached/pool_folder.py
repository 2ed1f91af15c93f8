"""A detached pool's folder: what its host process keeps of it, and the one place that names
its files.

::

    <runs root>/pools/<pool id>/
        pool.json      PoolInfo: ranks, their pids, started, last cell, who is attached (atomic)
        launch.json    the starting process's interpreter, environment, working directory,
                       sys.path, and the module the supervisor runs as the pool's host
        request.pkl    the pool's launch request
        host.log       the host process's own stdout/stderr (nbaccel's errors, if any)
        pool.sock      the host's socket (0600; elsewhere when the path is too long)

The folder is private (0700 under the 0700 runs root) and removed when the pool ends, so what
is listed is what runs. Nothing here knows notebooks: the host process that serves the pool is
named in ``launch.json`` by whoever starts it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbaccel.launch.detached.folder import write_atomic
from nbaccel.launch.detached.paths import private_dir, runs_root, socket_path

__all__ = ["PoolFolder", "PoolInfo", "find_pool", "list_pools", "pools_root"]

_POOLS = "pools"


def pools_root(root: Path | None = None) -> Path:
    """The folder of this user's detached pools (private), under the runs root."""
    return private_dir((runs_root() if root is None else root) / _POOLS)


@dataclass
class PoolInfo:
    """What ``pools()`` shows of a detached pool: ``pool.json``, written by its host."""

    id: str
    num_processes: int = 0
    started: float = field(default_factory=time.time)
    state: str = "starting"  # starting, running (ranks up), ending
    host_pid: int | None = None
    rank_pids: dict[str, int] = field(default_factory=dict)
    describe: str = ""
    last_cell: str = ""  # its first line
    last_cell_at: float | None = None
    attached: dict[str, Any] | None = None  # the kernel attached: pid, host, since
    detached_since: float | None = None
    idle: float = 3600.0  # seconds with no kernel attached before it ends
    versions: dict[str, str] = field(default_factory=dict)  # nbaccel, torch, python
    lost: str = ""  # ranks that ended while no kernel was attached, said once at attach

    def memory(self) -> int | None:
        """The ranks' resident memory now, in bytes (None when none can be read)."""
        import psutil

        total, seen = 0, False
        for pid in self.rank_pids.values():
            try:
                total += psutil.Process(pid).memory_info().rss
                seen = True
            except psutil.Error:
                continue
        return total if seen else None

    def holder(self) -> str:
        """Who holds the pool, in words: ``kernel 1234 on host`` or ``no kernel``."""
        if not self.attached:
            return "no kernel"
        return f"kernel pid {self.attached.get('pid')} on {self.attached.get('host', '?')}"

    def row(self) -> dict[str, str]:
        """The listing's columns, as text."""
        from nbaccel.values.byte_text import human_bytes

        at = self.last_cell_at
        last = f"{time.strftime('%H:%M:%S', time.localtime(at))} {self.last_cell}" if at else ""
        return {
            "id": self.id,
            "ranks": str(self.num_processes),
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started)),
            "last cell": last,
            "attached": self.holder() if self.attached else "no",
            "memory": human_bytes(self.memory()),
            "state": self.state,
        }


class PoolFolder:
    """One detached pool's folder (see the module docstring)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.id = self.path.name

    @classmethod
    def create(cls, root: Path | None = None) -> PoolFolder:
        """A new, empty, private folder with a fresh id (``pool-xxxxxx``)."""
        parent = pools_root(root)
        while True:
            pool_id = f"pool-{secrets.token_hex(3)}"
            try:
                (parent / pool_id).mkdir(mode=0o700)
            except FileExistsError:
                continue
            folder = cls(parent / pool_id)
            folder.write_info(PoolInfo(id=pool_id))
            return folder

    def file(self, name: str) -> Path:
        """The path of one of the folder's files (see the module docstring)."""
        return self.path / name

    @property
    def socket(self) -> Path:
        """The host's socket."""
        return socket_path(self.path, "pool.sock")

    def info(self) -> PoolInfo:
        """The pool's ``pool.json``."""
        data = json.loads(self.file("pool.json").read_text())
        known = {f.name for f in dataclasses.fields(PoolInfo)}
        return PoolInfo(**{k: v for k, v in data.items() if k in known})

    def write_info(self, info: PoolInfo) -> None:
        """Replace ``pool.json`` (atomically)."""
        write_atomic(self.file("pool.json"), json.dumps(dataclasses.asdict(info)).encode())

    def update(self, **changes: Any) -> PoolInfo:
        """Change some fields of ``pool.json``; the new info."""
        info = dataclasses.replace(self.info(), **changes)
        self.write_info(info)
        return info

    def remove(self) -> None:
        """Remove the folder and the host's socket: the pool has ended."""
        import shutil

        try:
            self.socket.unlink()
        except OSError:
            pass
        shutil.rmtree(self.path, ignore_errors=True)


def list_pools(root: Path | None = None) -> list[PoolInfo]:
    """This user's detached pools (default runs root), oldest first; a pool whose host
    process is gone without removing its folder is removed here."""
    from nbaccel.launch.host.processes import pid_alive

    parent = pools_root(root)
    found = []
    for path in parent.iterdir():
        if not (path / "pool.json").is_file():
            continue
        folder = PoolFolder(path)
        try:
            info = folder.info()
        except (OSError, ValueError, TypeError):
            continue  # being written: not one to show
        starting = info.host_pid is None and time.time() - info.started < 300
        if not starting and not (info.host_pid and pid_alive(info.host_pid)):
            folder.remove()  # its host was killed outright: nothing of it runs
            continue
        found.append(info)
    return sorted(found, key=lambda info: (info.started, info.id))


def find_pool(pool_id: str | None, root: Path | None = None) -> PoolFolder:
    """The folder of ``pool_id`` (or of the one pool whose id starts with it; None: the only
    pool, else the newest). KeyError naming the pools that exist when there is no such pool."""
    found = list_pools(root)
    ids = [info.id for info in found]
    if pool_id is None:
        matches = ids[-1:]
    else:
        matches = [i for i in ids if i == pool_id] or [i for i in ids if i.startswith(pool_id)]
    if len(matches) == 1:
        return PoolFolder(pools_root(root) / matches[0])
    if pool_id is None:
        raise KeyError("there is no detached pool of this user: start one with %%distributed "
                       "-n N --detach.")  # fmt: skip
    what = "matches several pools" if matches else "is not a detached pool of this user"
    raise KeyError(f"{pool_id!r} {what}; the detached pools are: {', '.join(ids) or 'none'}.")
