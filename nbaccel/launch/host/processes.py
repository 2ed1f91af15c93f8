"""Handles on worker processes, whatever started them, and the one way to describe their end.

The driver needs the same three things from each: the pid, the exit code once the process has
ended, and a way to signal the process and everything it started (dataloader workers included).
Launcher variants (``nbaccel.launch.launchers``) create the handles; :func:`describe_exit` is the
only place that turns an exit code into words.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Protocol

import psutil

__all__ = ["ExitReporter", "WorkerProcess", "describe_exit", "process_age"]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs: an exited child not yet reaped (a zombie) counts as
    gone, a process of another user as running."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def process_age(pid: int) -> float:
    """Seconds since process ``pid`` started. On Linux both ends are read on the boot clock
    (the start in ``/proc/PID/stat``, ``CLOCK_BOOTTIME`` now): no wall clock and no boot time
    enter, so a clock set since, or a container's own idea of when it booted, cannot skew it.
    Elsewhere: the wall clock now less psutil's start time. Raises ``psutil.NoSuchProcess``
    when the process is gone."""
    if hasattr(time, "CLOCK_BOOTTIME"):
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                text = stat.read()
        except FileNotFoundError:
            raise psutil.NoSuchProcess(pid) from None
        # after "(comm)" come the fields from the 3rd on; the 22nd is the start, in clock ticks
        ticks = int(text[text.rindex(b")") + 2 :].split()[22 - 3])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - psutil.Process(pid).create_time()


class ExitReporter(Protocol):
    """Something that learns the exit codes of processes it started (the fork server)."""

    def exitcode(self, pid: int) -> int | None: ...

    def ended_at(self, pid: int) -> float | None: ...

    def alive(self) -> bool: ...

    def describe_loss(self) -> str: ...

    def forget(self, pid: int) -> None: ...


class WorkerProcess:
    """One rank's process."""

    def __init__(
        self,
        pid: int,
        method: str,
        popen: subprocess.Popen | None = None,
        server: ExitReporter | None = None,
    ) -> None:
        self.pid = pid
        self.method = method
        self._popen = popen
        self._server = server
        self._returncode: int | None = None
        #: when the process ended (as close to its death as known), for failure ordering
        self.ended_at: float | None = None
        #: why the process is gone when it did not end by itself (its fork server died)
        self.lost: str = ""
        try:
            self._ps = psutil.Process(pid)
        except psutil.NoSuchProcess:
            self._ps = None

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while running."""
        if self._returncode is not None:
            return self._returncode
        if self._popen is not None:
            self._returncode = self._popen.poll()
        elif self._server is not None:
            self._returncode = self._server.exitcode(self.pid)
            if self._returncode is not None:
                self.ended_at = self._server.ended_at(self.pid)
            elif not self._server.alive():
                # Nobody can report this worker's end any more: end it now (it may still run,
                # orphaned, and keep talking to the driver) and say what took it.
                self._kill_tree(signal.SIGKILL)
                self._returncode = -int(signal.SIGKILL)
                self.lost = self._server.describe_loss()
        else:  # forked by the driver itself
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.pid, 0
            if pid:
                self._returncode = os.waitstatus_to_exitcode(status)
        if self._returncode is not None:
            if self.ended_at is None:
                self.ended_at = time.time()
            if self._server is not None:
                self._server.forget(self.pid)
        return self._returncode

    def ignores(self, sig: int) -> bool:
        """True when this running process has ``sig`` set to ignored (``signal.SIG_IGN``): a
        stop that waits for it to react to that signal would wait for nothing. False when
        unknown (no ``/proc``) or when it has ended."""
        if self.poll() is not None:
            return False
        try:
            with open(f"/proc/{self.pid}/status") as status:
                for line in status:
                    if line.startswith("SigIgn:"):
                        return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
        except (OSError, ValueError, IndexError):
            pass
        return False

    def signal_tree(self, sig: int) -> None:
        """Send ``sig`` to this worker and all its descendants."""
        if self.poll() is None:
            self._kill_tree(sig)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to this worker alone (not its children)."""
        if self.poll() is None:
            self._signal_self(sig)

    def _signal_self(self, sig: int) -> None:
        try:
            if self._ps is not None:
                self._ps.send_signal(sig)  # psutil refuses a pid reused by another process
            else:
                os.kill(self.pid, sig)
        except (ProcessLookupError, psutil.Error):
            pass

    def _kill_tree(self, sig: int) -> None:
        targets = []
        if self._ps is not None:
            try:
                targets = self._ps.children(recursive=True)
            except psutil.Error:
                targets = []
        for proc in targets:
            try:
                proc.send_signal(sig)
            except psutil.Error:
                pass
        self._signal_self(sig)


_HINTS = {
    signal.SIGKILL: "SIGKILL usually means the host ran out of RAM (the kernel's OOM killer); "
    "use a smaller batch or model, or fewer processes. On Colab/Kaggle TPUs, create the model "
    "once outside the launched function and pass it in, so the processes share host RAM.",
    signal.SIGSEGV: "SIGSEGV is a crash in native code; on Colab/Kaggle TPU hosts it is most often "
    "host RAM exhaustion. Otherwise look for mismatched library versions.",
    signal.SIGBUS: "SIGBUS often means /dev/shm is full; increase shared memory or use fewer "
    "dataloader workers.",
}


def describe_exit(returncode: int) -> str:
    """A sentence for how a process ended: exit code, or signal name and a hint."""
    if returncode >= 0:
        return f"exited with code {returncode} before returning a result"
    sig = signal.Signals(-returncode)
    hint = _HINTS.get(sig, "")
    return f"was killed by {sig.name} (signal {int(sig)})" + (f". {hint}" if hint else "")
