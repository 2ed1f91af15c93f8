"""How much memory this process can still be given: the system's available RAM, lowered by the
tightest cgroup limit above the process (a container's, a SLURM job's, a systemd slice's).

``MemAvailable`` alone is the host's figure; inside a container limited to 8 GiB on a 64 GiB host
it overstates what a launch or a CPU offload budget may use by 8x, and the OOM killer, not an
error, says so. The launch's capacity check, its host-RAM estimate and the big-model CPU budget
all read :func:`available_memory`.
"""

from __future__ import annotations

import functools
import os

import psutil

__all__ = ["available_memory", "read_int"]


def read_int(path: str) -> int | None:
    """The integer a one-line file (``/proc``, ``/sys``) holds; None when absent or not one
    (cgroup v2 writes ``max`` for no limit). Read without Python's file layers: every launch
    reads a few of these."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        text = os.read(fd, 64).strip()
    except OSError:
        return None
    finally:
        os.close(fd)
    return int(text) if text.isdigit() else None


#: what a group's limit, usage and reclaimable page cache are called: cgroup v2, v1
_V2 = ("memory.max", "memory.current", "inactive_file")
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


@functools.cache
def _cgroup_dirs() -> tuple[tuple[str, tuple[str, str, str]], ...]:
    """This process's memory cgroup folders that can hold a limit (with their file names), its
    own first, then each parent up to the root visible here: a limit on any of them applies.
    Read once: a process stays in its group."""
    try:
        with open("/proc/self/cgroup") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return ()
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            root, names = "/sys/fs/cgroup", _V2
        elif "memory" in controllers.split(","):
            root, names = "/sys/fs/cgroup/memory", _V1
        else:
            continue
        parts = [part for part in path.split("/") if part and part != ".."]
        for depth in range(len(parts), -1, -1):
            folder = os.path.join(root, *parts[:depth])
            if os.path.exists(os.path.join(folder, names[0])):
                found.append((folder, names))
    return tuple(found)


def _cgroup_room() -> int | None:
    """Bytes the tightest cgroup memory limit above this process still allows (None: none)."""
    room = None
    for folder, (limit_file, usage_file, cache) in _cgroup_dirs():
        limit = read_int(os.path.join(folder, limit_file))  # v2's "max" (none) reads as None
        if limit is None or limit >= 1 << 60:  # v1's "no limit": a page-rounded 2**63
            continue
        used = read_int(os.path.join(folder, usage_file))
        if used is None:
            continue
        # the group's usage counts the page cache; its inactive part is reclaimed before anyone
        # is killed, so it is room (the working set, as container runtimes count it)
        free = max(0, limit - max(0, used - _stat(folder, cache)))
        room = free if room is None else min(room, free)
    return room


def _stat(folder: str, key: str) -> int:
    """One counter of the group's ``memory.stat`` (0 when absent)."""
    try:
        with open(os.path.join(folder, "memory.stat")) as handle:
            for line in handle:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def available_memory() -> int:
    """Bytes of memory this process can still be given: the system's ``MemAvailable``, lowered
    by the tightest cgroup limit above it (a container's, a SLURM job's, a systemd slice's)."""
    available = psutil.virtual_memory().available
    room = _cgroup_room()
    return available if room is None else min(available, room)
