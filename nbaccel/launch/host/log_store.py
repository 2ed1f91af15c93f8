"""Where the full output logs of a process go, how much disk they may take, and when they go.

A call whose output goes past what the notebook shows writes every line to a log file
(``nbaccel.launch.driver.output_budget``). A kernel lives for hours: its logs share one size budget
(``NBACCEL_LOG_BUDGET_MB``, default 256 MB per process); when a write would pass it, this
process's oldest logs are removed first, and a log that alone fills the budget stops growing
(what was dropped is counted and announced). The logs are removed when the process (the
kernel) exits, unless ``NBACCEL_KEEP_LOGS=1`` is set or :func:`keep_logs` was called.
"""

from __future__ import annotations

import atexit
import os
import tempfile
import threading
import time
from typing import IO

from nbaccel.launch.host.processes import pid_alive
from nbaccel.values.booleans import env_flag

__all__ = [
    "LOG_BUDGET_VAR",
    "LOG_DIR_VAR",
    "LogStore",
    "keep_logs",
    "log_dir",
    "reclaim_after",
    "store",
]

LOG_DIR_VAR = "NBACCEL_LOG_DIR"
LOG_BUDGET_VAR = "NBACCEL_LOG_BUDGET_MB"
KEEP_LOGS_VAR = "NBACCEL_KEEP_LOGS"
_DEFAULT_BUDGET_MB = 256.0


def log_dir() -> str:
    """Where full logs go: ``$NBACCEL_LOG_DIR``, else ``<tmp>/nbaccel-logs-<uid>``."""
    chosen = os.environ.get(LOG_DIR_VAR)
    if not chosen:
        uid = os.getuid() if hasattr(os, "getuid") else "user"
        chosen = os.path.join(tempfile.gettempdir(), f"nbaccel-logs-{uid}")
    os.makedirs(chosen, mode=0o700, exist_ok=True)
    return chosen


def _budget() -> int:
    try:
        megabytes = float(os.environ.get(LOG_BUDGET_VAR, _DEFAULT_BUDGET_MB))
    except ValueError:
        megabytes = _DEFAULT_BUDGET_MB
    return max(0, int(megabytes * 1024 * 1024))


def _keep_by_env() -> bool:
    return bool(env_flag(KEEP_LOGS_VAR))


class LogStore:
    """The logs this process wrote, oldest first, with their sizes (bytes)."""

    def __init__(self) -> None:
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()
        self._keep = False
        self._atexit = False
        self._pid = os.getpid()

    @property
    def budget(self) -> int:
        """Bytes all of this process's logs may take together."""
        return _budget()

    def open(self, label: str) -> tuple[str, IO[str]]:
        """A new log file for ``label`` (``launch``, ``cell``): its path and open handle."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        handle = tempfile.NamedTemporaryFile(  # noqa: SIM115 - the caller closes it
            "w",
            dir=log_dir(),
            prefix=f"{stamp}-{os.getpid()}-{label.replace(' ', '-')}-",
            suffix=".log",
            delete=False,
            encoding="utf-8",
            errors="replace",
        )
        with self._lock:
            if os.getpid() != self._pid:  # a forked child starts its own list
                self._sizes, self._pid, self._atexit = {}, os.getpid(), False
            self._sizes[handle.name] = 0
            if not self._atexit:
                atexit.register(self.remove_all)
                self._atexit = True
        return handle.name, handle

    def reserve(self, path: str, nbytes: int) -> bool:
        """Room for ``nbytes`` more in ``path``: True when granted (older logs of this process
        may be removed to make it), False when ``path`` alone already fills the budget."""
        budget = self.budget
        with self._lock:
            if path not in self._sizes:
                return True  # not ours to count (a log opened before a fork)
            total = sum(self._sizes.values())
            for older in list(self._sizes):
                if total + nbytes <= budget or older == path:
                    break
                total -= self._sizes.pop(older)
                _remove(older)
            if total + nbytes > budget:
                return False
            self._sizes[path] += nbytes
            return True

    def paths(self) -> list[str]:
        """This process's logs still on disk, oldest first."""
        with self._lock:
            return list(self._sizes)

    def keep(self, keep: bool = True) -> None:
        """Keep (or not) this process's logs when it exits."""
        self._keep = keep
        marker = _keep_marker(os.getpid())
        try:
            if keep:
                open(marker, "w").close()
            elif os.path.exists(marker):
                os.unlink(marker)
        except OSError:
            pass

    def remove_all(self) -> None:
        """Remove this process's logs (at exit), unless they are to be kept."""
        if self._keep or _keep_by_env() or os.getpid() != self._pid:
            return
        with self._lock:
            paths, self._sizes = list(self._sizes), {}
        for path in paths:
            _remove(path)

    def exit_note(self) -> str:
        """What happens to the logs at exit, for notices."""
        if self._keep or _keep_by_env():
            return ""
        return f" (removed when this process exits; {KEEP_LOGS_VAR}=1 keeps it)"


def _keep_marker(pid: int) -> str:
    return os.path.join(log_dir(), f".keep-{pid}")


def reclaim_after(owner: int, wait: float = 0.0) -> None:
    """Remove the logs of process ``owner`` if it has died (within ``wait`` seconds): called by
    a helper process that outlives it (the fork server, as it exits), so that a kernel killed
    without running its ``atexit`` hooks leaves no logs behind either, unless they were to be
    kept. A living owner removes its own logs when it exits."""
    deadline = time.monotonic() + wait
    while pid_alive(owner):
        if time.monotonic() >= deadline:
            return  # still running: its own exit removes them
        time.sleep(0.05)
    try:
        folder = log_dir()
        names = os.listdir(folder)
    except OSError:
        return
    marker = f".keep-{owner}"
    if marker in names or _keep_by_env():
        _remove(os.path.join(folder, marker))
        return
    for name in names:
        if name.endswith(".log") and f"-{owner}-" in name:
            _remove(os.path.join(folder, name))


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


store = LogStore()


def keep_logs(keep: bool = True) -> None:
    """Keep this process's full-output logs after it exits (default: they are removed)."""
    store.keep(keep)
