"""What ``%dist_status`` shows of a pool: one row per rank, and which ranks are still alive.

The ranks answer for themselves when they can (device, memory, names defined); what the kernel
knows of them fills the rest (pid, uptime, busy or idle), so a rank that is busy, stuck or gone
still has its row, saying so. ``pool`` is a :class:`~nbaccel.notebook.kernel.pool.Pool` (typed
``Any``: the pool imports this module).
"""

from __future__ import annotations

import time
from typing import Any

import psutil

from nbaccel.launch.driver.group import WorkerGroup
from nbaccel.launch.host.processes import pid_alive, process_age
from nbaccel.launch.wire.errors import LaunchTimeout
from nbaccel.notebook.rank import pool_worker

__all__ = ["alive_ranks", "status_rows"]


def status_rows(pool: Any, timeout: float = 5.0) -> list[dict[str, Any]]:
    """One row per rank of ``pool``: pid, device, memory, state (idle/busy/exited), uptime
    (the rank process's age; on other hosts, the time since the pool started).

    Ranks still busy after ``timeout`` seconds show what this kernel knows of them; when the
    ranks could not answer for another reason, each row says why (``problem``)."""
    group = pool.group
    details: dict[int, Any] = {}
    problem = None
    if group is not None and group.alive():
        try:
            details = pool.call(pool_worker.worker_status, timeout=timeout)
        except LaunchTimeout:
            pass  # busy ranks: their rows say so
        except Exception as exc:  # shown in the table, not swallowed
            problem = f"{type(exc).__name__}: {exc}"
    rows = []
    for rank in pool.ranks:
        pid = pool.pids.get(rank)
        row: dict[str, Any] = {"rank": rank, "pid": pid, **pool.info.get(rank, {})}
        row.update(details.get(rank, {}))
        row["names"] = len(row["names"]) if isinstance(row.get("names"), list) else "-"
        if pool.remote is not None:  # on another host: what its agent reported
            running = group is not None and rank in alive_ranks(group)
            if pool.started_at is not None:  # this kernel's monotonic clock at the start
                row["uptime"] = time.monotonic() - pool.started_at
        else:
            try:
                process = psutil.Process(pid)
                row["uptime"] = process_age(process.pid)
                row.setdefault("rss", process.memory_info().rss)
                running = process.status() != psutil.STATUS_ZOMBIE
            except (psutil.Error, OSError, TypeError, ValueError):
                running = False
        busy = group is not None and group.busy(rank)
        row["state"] = "exited" if not running else ("busy" if busy else "idle")
        if problem is not None:
            row["problem"] = problem
        rows.append(row)
    return rows


def alive_ranks(group: WorkerGroup) -> list[int]:
    """The ranks of ``group`` whose process still runs (not a zombie)."""
    if not group.launcher.local_memory:  # ranks on other hosts: their agents report exits
        return group.running_ranks()
    return [rank for rank, pid in group.pids.items() if pid_alive(pid)]
