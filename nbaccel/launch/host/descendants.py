"""What a process started, found and ended: a rank's descendants end with its launch.

Linux lets a process declare itself a *child subreaper* (``PR_SET_CHILD_SUBREAPER``): orphans
among its descendants are re-parented to it instead of to init. Every rank is one, however it
was started (forked from the kernel, from the fork server, from a host's agent, spawned), so a
daemon that double-forked into a session of its own (``setsid``) still sits below the rank that
started it. When the rank's work ends, :func:`end_descendants` ends them all (SIGTERM, then
SIGKILL after :data:`KILL_AFTER` seconds) and says which; the fork server ends what a rank that
died by a signal leaves (``launchers.forkserver.reaper``).

A process meant to outlive its launch opts out: start it with ``NBACCEL_DETACH=1`` in the
environment it is *executed* with; it is left alone, and so is what it starts.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import signal
import time
from typing import Any

from nbaccel.values.booleans import parse_bool

__all__ = [
    "DETACH_ENV",
    "KILL_AFTER",
    "become_subreaper",
    "children",
    "descendants",
    "detached",
    "end_descendants",
]

_PR_SET_CHILD_SUBREAPER = 36
DETACH_ENV = "NBACCEL_DETACH"
KILL_AFTER = 1.0  # s between SIGTERM and SIGKILL


@functools.cache
def _prctl() -> Any:
    """libc's prctl, looked up once: forked ranks inherit it ready."""
    return ctypes.CDLL(None, use_errno=True).prctl


def become_subreaper() -> bool:
    """Adopt this process's orphaned descendants (Linux); False where unsupported."""
    if not os.path.exists("/proc/self"):
        return False
    try:
        return _prctl()(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def children(pid: int | str = "self") -> set[int]:
    """The direct children of ``pid`` (every thread's, as Linux lists them)."""
    paths = glob.glob(f"/proc/{pid}/task/*/children")
    if not paths:  # a kernel built without CONFIG_PROC_CHILDREN (or not Linux): ask psutil
        import psutil

        try:
            process = psutil.Process() if pid == "self" else psutil.Process(int(pid))
            return {child.pid for child in process.children()}
        except psutil.Error:
            return set()
    pids: set[int] = set()
    for path in paths:
        try:
            with open(path) as handle:
                pids.update(int(found) for found in handle.read().split())
        except (OSError, ValueError):
            continue
    return pids


def detached(pid: int) -> bool:
    """``pid`` was executed with ``NBACCEL_DETACH`` set to a true word (``1``, ``yes``...):
    meant to outlive its launch."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            entries = handle.read().split(b"\0")
    except OSError:
        return True  # gone already, or not ours to read: leave it
    prefix = f"{DETACH_ENV}=".encode()
    for entry in entries:
        if entry.startswith(prefix):
            try:
                return parse_bool(entry[len(prefix) :].decode(errors="replace"), DETACH_ENV)
            except ValueError:  # another process's word: not ours to refuse; it is not asked
                return False
    return False


def descendants(pid: int | str = "self") -> list[int]:
    """Every process below ``pid``, parents first; a detached one and what is below it left out."""
    found: list[int] = []
    todo = sorted(children(pid))
    while todo:
        child = todo.pop(0)
        if child in found or detached(child):
            continue
        found.append(child)
        todo += sorted(children(child))
    return found


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            words = handle.read().split(b"\0")
        return os.path.basename(words[0].decode(errors="replace")) or str(pid)
    except (OSError, IndexError):
        return str(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _reap() -> None:
    """Collect this process's ended children (zombies), without waiting."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return


def end_descendants(kill_after: float = KILL_AFTER) -> list[str]:
    """End every process below this one (SIGTERM, SIGKILL after ``kill_after`` s); the names
    (``sleep (pid 42)``) of those that were running. Returns at once when there are none."""
    pids = descendants()
    if not pids:
        return []
    ended = [f"{_name(pid)} (pid {pid})" for pid in pids]
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline, killed = time.monotonic() + kill_after, False
    while True:
        _reap()
        pids = [pid for pid in descendants() if _alive(pid)]  # orphans adopted meanwhile too
        if not pids:
            return ended
        if time.monotonic() >= deadline:
            if killed:  # SIGKILLed a grace ago and still there (uninterruptible): leave it
                return ended
            for pid in pids:
                _signal(pid, signal.SIGKILL)
            deadline, killed = time.monotonic() + kill_after, True
        time.sleep(0.01)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
