"""What this machine can hold: refuse a launch that cannot start, before anything starts.

Two limits are checked, each with the numbers and the fix in its error:

- processes: each rank is a process with a few threads, and every thread draws from the
  system's pid space (``kernel.pid_max``, ``kernel.threads-max``) and from the user's
  ``RLIMIT_NPROC`` (``ulimit -u``; root is exempt);
- memory: each rank costs at least :data:`RANK_FLOOR_BYTES` of private memory when it is
  forked from the fork server (page tables, stacks, the pages Python's reference counts
  dirty), and a whole interpreter with torch imported when it
  is started fresh (``spawn``: the fork server's own resident size, measured when one runs).
  Available memory is the system's ``MemAvailable``, lowered by the tightest cgroup memory limit
  above this process (:func:`~nbaccel.distributed.host_memory.available_memory`).

The figures are floors, not forecasts: what the function itself allocates comes on top. They
exist to stop a typo (``num_processes=10000``, ``2**63``) from growing the kernel until the OOM
killer ends it.
"""

from __future__ import annotations

import os
import resource

from nbaccel.distributed.host_memory import available_memory, read_int

__all__ = ["RANK_FLOOR_BYTES", "RANK_TASKS", "check_capacity"]

RANK_FLOOR_BYTES = 16 << 20  # private memory of a forked rank, at least
RANK_TASKS = 4  # threads of a rank before it runs anything (main, driver watch, gloo, ...)
_SPAWN_FLOOR_BYTES = 256 << 20  # a fresh interpreter with torch, when no server was measured
_MiB = 1 << 20


def _tasks_in_use() -> int | None:
    """Threads on the system now (the 4th field of /proc/loadavg: running/total)."""
    try:
        with open("/proc/loadavg") as handle:
            return int(handle.read().split()[3].split("/")[1])
    except (OSError, IndexError, ValueError):
        return None


def _user_tasks() -> int:
    """Threads of processes owned by this user (what RLIMIT_NPROC counts)."""
    import psutil

    uid, count = os.getuid(), 0
    for proc in psutil.process_iter(["uids", "num_threads"]):
        uids, threads = proc.info["uids"], proc.info["num_threads"]
        if uids is not None and uids.real == uid:
            count += threads or 1
    return count


def _process_limit(num_processes: int) -> str | None:
    need = num_processes * RANK_TASKS
    in_use = _tasks_in_use()
    for name, path in (
        ("kernel.pid_max", "/proc/sys/kernel/pid_max"),
        ("kernel.threads-max", "/proc/sys/kernel/threads-max"),
    ):
        limit = read_int(path)
        if limit is not None and in_use is not None and in_use + need > limit:
            return (
                f"num_processes={num_processes} needs about {need} threads ({RANK_TASKS} per "
                f"rank) but this machine has {limit - in_use} left ({name}={limit}, {in_use} "
                f"in use). Use at most {max(1, (limit - in_use) // RANK_TASKS)} processes."
            )
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and os.geteuid() != 0 and need > soft - (in_use or 0):
        mine = _user_tasks()  # exact, and only when the cheap bound says it may matter
        if mine + need > soft:
            left = max(0, soft - mine)
            return (
                f"num_processes={num_processes} needs about {need} threads ({RANK_TASKS} per "
                f"rank) but your process limit leaves {left} (ulimit -u = {soft}, {mine} in "
                f"use). Use at most {max(1, left // RANK_TASKS)} processes, or raise the limit "
                "(ulimit -u) before starting Jupyter."
            )
    return None


def _memory_limit(num_processes: int, per_rank: int) -> str | None:
    available = available_memory()
    if num_processes * per_rank <= available:
        return None
    return (
        f"num_processes={num_processes} needs at least {num_processes * per_rank // _MiB} MiB "
        f"({per_rank // _MiB} MiB per rank before it runs anything) but {available // _MiB} MiB "
        f"of memory is available. Use at most {max(1, available // per_rank)} processes."
    )


def check_capacity(num_processes: int, forked: bool = True, server_rss: int | None = None) -> None:
    """ValueError with the numbers and the fix when this machine cannot hold the ranks.

    ``forked``: ranks are forked from a server with torch loaded (cheap); otherwise each is a
    fresh interpreter costing about ``server_rss`` bytes (the fork server's measured size).
    """
    per_rank = RANK_FLOOR_BYTES if forked else (server_rss or _SPAWN_FLOOR_BYTES)
    problem = _process_limit(num_processes) or _memory_limit(num_processes, per_rank)
    if problem is not None:
        raise ValueError(f"this machine cannot hold the launch: {problem}")
