"""The driver's handle on one fork server process: start it, ask it for ranks and imports,
learn their exit codes, what it imported and what made it unsafe to fork.

The process-wide server (its generations, the kernel's modules sent to it, the launcher) is
:mod:`nbaccel.launch.launchers.forkserver.launcher`; the server's own loop and protocol is
:mod:`nbaccel.launch.launchers.forkserver.loop`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from nbaccel.launch.host.processes import describe_exit
from nbaccel.launch.launchers.forkserver import hold as server_hold
from nbaccel.launch.launchers.forkserver.hold import (
    HOLD_SIGNAL,
    RELEASE_SIGNAL,
    hold_signals_blocked,
)
from nbaccel.launch.launchers.forkserver.kernel_modules import (
    changed_files,
    file_stamps,
    is_candidate,
)
from nbaccel.launch.launchers.forkserver.loop import (
    ENGINE_PRELOAD,
    CudaInitializedInServer,
    read_frame,
    serve,
    write_frame,
)
from nbaccel.launch.wire.protocol import ServerMessage

__all__ = ["ForkServer", "ForkedServerProcess", "ProcessStartError"]

_TELL_WAIT_AFTER = 0.25  # seconds a launch waits for the server before it says so


class ProcessStartError(RuntimeError):
    """The system refused to create a rank's process (process limit, memory)."""


class ForkedServerProcess:
    """The server forked from this process instead of started fresh: for a process that has
    imported torch already and started no thread yet (the remote agent), which saves a second
    ``import torch``. Offers what :class:`ForkServer` uses of a ``Popen``."""

    def __init__(self, preload: Iterable[str] = ()) -> None:
        to_server, from_driver = os.pipe()
        from_server, to_driver = os.pipe()
        with hold_signals_blocked():  # the server inherits the block (serve() lifts it)
            pid = os.fork()
            if pid == 0:  # the server: its stdin/stdout are the pipes, nothing else of the parent's
                code = 1
                try:
                    os.dup2(to_server, 0)
                    os.dup2(to_driver, 1)
                    for fd in (to_server, from_driver, from_server, to_driver):
                        os.close(fd)
                    serve(preload)
                    code = 0
                finally:
                    os._exit(code)
        os.close(to_server)
        os.close(to_driver)
        self.pid = pid
        self.stdin = os.fdopen(from_driver, "wb")
        self.stdout = os.fdopen(from_server, "rb")
        self._code: int | None = None

    def poll(self) -> int | None:
        if self._code is None:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                done, status = self.pid, 0
            if done:
                self._code = os.waitstatus_to_exitcode(status)
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"fork server {self.pid}", timeout)
            time.sleep(0.01)
        return self._code

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


class ForkServer:
    """Driver-side handle: start the server, ask it for workers, learn their exit codes.

    ``fork=True`` forks the server from this process (see :class:`ForkedServerProcess`).
    ``own_stamps=True``: the server notes the files of the modules it mirrors itself (a host's
    agent, whose kernel is on another machine), for :meth:`stale`.
    """

    def __init__(
        self, preload: Iterable[str] = (), fork: bool = False, own_stamps: bool = False
    ) -> None:
        bootstrap = (  # the stop button (SIGINT to the process group) must not hit the imports
            "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "import sys, json, importlib.util as u; sys.path[:] = json.loads(sys.argv[1]); "
            # the hold first, by its file: `import nbaccel` imports torch, which it may hold
            "s = u.spec_from_file_location(sys.argv[3], sys.argv[4]); "
            "m = sys.modules[s.name] = u.module_from_spec(s); s.loader.exec_module(m); "
            "m.install(); "
            "from nbaccel.launch.launchers.forkserver.loop import serve; "
            "serve(json.loads(sys.argv[2]))"
        )
        self.preloaded = set(ENGINE_PRELOAD) | set(preload)
        self.front = set(preload)  # what the fronts asked for (a new generation asks again)
        self.mirrored: set[str] = set()  # the kernel's modules sent to be imported
        self.imported: list[str] = []  # top-level modules the server imported for them
        self.import_seconds = 0.0
        #: module -> why: the imports that made forking it unsafe
        self.unsafe: dict[str, str] = {}
        self.announced = False  # the launch summary named what ranks start with
        #: (len(sys.modules), exclusions) when the kernel's modules were last sent to it
        self.scanned: tuple[int, frozenset[str]] | None = None
        self._stamps: dict[str, tuple[str, int]] = {}  # the user files of what was mirrored
        self.own_stamps = own_stamps
        self._unstamped: set[str] = set()
        self._pids: set[int] = set()  # its ranks still running
        self._pending = 0  # modules sent to import that the server has not answered for yet
        self.held = False  # its imports wait for the ranks forked from the kernel (hold())
        self._sent_environ = dict(os.environ)  # what the server started with
        if fork:
            self._proc: Any = ForkedServerProcess(sorted(preload))
        else:
            with hold_signals_blocked():
                self._proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        bootstrap,
                        json.dumps(sys.path),
                        json.dumps(sorted(preload)),
                        server_hold.MODULE,
                        server_hold.__file__,
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    close_fds=True,
                    # A session of its own: the stop button (SIGINT to the kernel's process group)
                    # reaches the ranks through the driver, never the server's imports; and the
                    # kernel's shutdown, which signals and then waits on its process group, does
                    # not wait on the server and its ranks (they end when the kernel's pipe closes).
                    start_new_session=True,
                )
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._ready = False
        # request -> pid, or (FAILED or REFUSED, why) when the server did not fork
        self._started: dict[int, int | tuple[str, str]] = {}
        self._exits: dict[int, tuple[int, float]] = {}
        self._next_id = 0
        self._listeners: list[Any] = []
        self._reading = True  # until the reader thread's last step (alive() reads it, no call)
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name="nbaccel-fs")
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        # No system call (this is asked for every rank at every cell): the reader thread ends
        # when the server's pipe closes, and reaps the server first.
        return self._reading or self._proc.poll() is None

    def _read_loop(self) -> None:
        try:
            self._read_until_closed()
        finally:
            self._reading = False

    def _read_until_closed(self) -> None:
        fd = self._proc.stdout.fileno()
        while True:
            try:
                message = read_frame(fd)
            except (EOFError, OSError):
                break
            with self._cond:
                if message[0] == ServerMessage.READY:
                    self._ready = True
                elif message[0] == ServerMessage.STARTED:
                    self._started[message[1]] = message[2]
                    self._pids.add(message[2])
                elif message[0] == ServerMessage.PRELOADED:
                    self.imported += [m for m in message[1] if _worth_naming(m, self.imported)]
                    self.import_seconds += message[2]
                    self._pending -= message[3]
                    if len(message) > 4:  # the files the server itself imported (own_stamps)
                        self._stamps.update(message[4])
                elif message[0] == ServerMessage.UNSAFE:
                    self.unsafe.update(message[1])
                elif message[0] in (ServerMessage.FAILED, ServerMessage.REFUSED):
                    self._started[message[1]] = (message[0], message[2])
                elif message[0] == ServerMessage.EXITED:
                    self._exits[message[1]] = (message[2], message[3])
                    self._pids.discard(message[1])
                self._cond.notify_all()
            self._wake_all()
        # The server ended (or closed its stdout to die): reap it now. A zombie child keeps
        # ipykernel's shutdown signalling and sleeping for seconds, until Jupyter kills the kernel
        # before its atexit cleanup runs.
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        with self._cond:
            self._ready = False
            self._cond.notify_all()
        self._wake_all()

    def _wake_all(self) -> None:
        # a function of its own: a loop variable in _read_loop's frame would keep the last
        # launch's worker group (and its results) alive until the next message
        for wake in list(self._listeners):
            wake()

    def add_wakeup(self, callback: Any) -> None:
        """Call ``callback()`` from the reader thread whenever the server reports something."""
        self._listeners.append(callback)

    def remove_wakeup(self, callback: Any) -> None:
        if callback in self._listeners:
            self._listeners.remove(callback)

    def importing(self) -> bool:
        """True while the server is still importing (torch at its start, or modules sent)."""
        return not self._ready or self._pending > 0

    def ready(self) -> bool:
        """True once the server has imported its preload and forks on request."""
        return self._ready

    def hold(self) -> None:
        """Pause the server's imports (at the next module; for at most ``HOLD_AT_MOST``
        seconds) so that ranks forked from the kernel meanwhile have the cores to themselves."""
        if HOLD_SIGNAL is not None and not self.held and self._signal(HOLD_SIGNAL):
            self.held = True

    def release(self) -> None:
        """Let the server's imports go on (after :meth:`hold`)."""
        if self.held and RELEASE_SIGNAL is not None:
            self.held = False
            self._signal(RELEASE_SIGNAL)

    def _signal(self, number: int) -> bool:
        if self._proc.poll() is not None:
            return False
        try:
            os.kill(self.pid, number)
        except ProcessLookupError:
            return False
        return True

    def wait_ready(self, timeout: float = 120.0) -> None:
        started = time.monotonic()
        deadline = started + timeout
        told = False
        with self._cond:
            while not self._ready:
                if not told and time.monotonic() - started > _TELL_WAIT_AFTER:
                    told = True  # the first launch of a kernel: say why it takes a moment
                    print(
                        "[nbaccel] starting the fork server (it imports torch once per kernel; "
                        "later launches take a fork)...",
                        flush=True,
                    )
                if not self.alive() or time.monotonic() > deadline:
                    raise RuntimeError(
                        "nbaccel's fork server did not start (is torch importable in this "
                        "environment?); pass start_method='spawn' to launch without it."
                    )
                self._cond.wait(0.1)

    def preload(self, modules: Iterable[str]) -> None:
        """Have the server import ``modules`` (once) before its next fork."""
        missing = sorted(set(modules) - self.preloaded)
        if missing:
            with self._lock:
                with self._cond:  # the reader thread counts the answers down
                    self._pending += len(missing)
                write_frame(self._proc.stdin.fileno(), (ServerMessage.PRELOAD, missing))
            self.preloaded.update(missing)

    def mirror(
        self,
        modules: Iterable[str],
        quiet: bool = True,
        stamp: bool = True,
        path: Iterable[str] | None = None,
    ) -> None:
        """Have the server import ``modules``, the kernel's (once each, with ``path``, by
        default this process's ``sys.path``; ``quiet``: one that fails is left to the ranks
        without a word), and (``stamp``) note the files of those the kernel holds, to see them
        change (:meth:`stale`)."""
        missing = [m for m in modules if m not in self.mirrored and m not in self.preloaded]
        if missing:
            with self._lock:
                options: dict[str, Any] = {
                    "path": list(sys.path if path is None else path),
                    "quiet": quiet,
                }
                if self.own_stamps:
                    options["stamps"] = True
                environ = dict(os.environ)
                if environ != self._sent_environ:  # set before an import reads it (HF_HOME...)
                    options["environ"] = self._sent_environ = environ
                with self._cond:  # the reader thread counts the answers down
                    self._pending += len(missing)
                write_frame(self._proc.stdin.fileno(), (ServerMessage.PRELOAD, missing, options))
            self.mirrored.update(missing)
            self._unstamped.update(missing)
        if stamp and self._unstamped:  # once the kernel holds them (the import hook is early)
            present = {m for m in self._unstamped if m in sys.modules}
            self._stamps.update(file_stamps(present))
            self._unstamped -= present

    def stale(self) -> list[str]:
        """The mirrored modules whose file changed since the server imported them."""
        return changed_files(dict(self._stamps))  # a copy: the reader thread may add to it

    def rss(self) -> int | None:
        """The server's resident memory in bytes (None where ``/proc`` is missing)."""
        try:
            with open(f"/proc/{self.pid}/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError):
            pass
        return None

    def running_ranks(self) -> int:
        """How many of the ranks it forked still run."""
        return len(self._pids)

    def spawn(self, spec_bytes: bytes) -> int:
        """Fork one worker running ``spec``; return its pid (see :meth:`spawn_many`)."""
        return self.spawn_many([spec_bytes])[0]

    def spawn_many(
        self, specs: Sequence[bytes], while_waiting: Callable[[float], object] | None = None
    ) -> list[int]:
        """Fork one worker per spec; return their pids in order.

        Every request is written before the first pid is awaited, so the server forks rank
        after rank while the early ones already start, instead of one round trip per rank.
        Raises :class:`CudaInitializedInServer` when a preloaded module initialised CUDA, and
        :class:`ProcessStartError` when the system refused a fork; the ranks of the batch that
        did start are killed first (nothing of a refused batch survives). ``while_waiting(timeout)``
        replaces the wait for each answer (it must return once :meth:`add_wakeup`'s callbacks
        are called, or after ``timeout`` seconds)."""
        self.release()
        self.wait_ready()
        with self._lock:
            first = self._next_id
            self._next_id += len(specs)
            stdin = self._proc.stdin.fileno()
            for request_id, spec_bytes in enumerate(specs, first):
                write_frame(stdin, (ServerMessage.SPAWN, request_id, spec_bytes))
        answers = [
            self._await_started(request_id, while_waiting)
            for request_id in range(first, first + len(specs))
        ]
        pids = [answer for answer in answers if isinstance(answer, int)]
        refusal = next((answer for answer in answers if not isinstance(answer, int)), None)
        if refusal is None:
            return pids
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        kind, why = refusal
        if kind == ServerMessage.REFUSED:
            raise CudaInitializedInServer(why)
        raise ProcessStartError(
            f"the system refused a new rank process ({why}): the process limit (ulimit -u, "
            "kernel.pid_max) or the memory is exhausted. Use fewer processes, or end "
            "processes that are no longer needed."
        )

    def _await_started(
        self, request_id: int, while_waiting: Callable[[float], object] | None = None
    ) -> int | tuple[str, str]:
        """The server's answer to spawn request ``request_id``: a pid, or (kind, why)."""
        while True:
            with self._cond:
                if request_id in self._started:
                    return self._started.pop(request_id)
                if not self.alive():
                    raise RuntimeError("nbaccel's fork server exited while starting a worker")
                if while_waiting is None:
                    self._cond.wait(0.1)
                    continue
            while_waiting(0.1)

    def exitcode(self, pid: int) -> int | None:
        # one dict lookup, atomic on its own: asked for every rank before every pool call,
        # so it takes no lock (the reader thread only ever adds whole entries)
        entry = self._exits.get(pid)
        return None if entry is None else entry[0]

    def ended_at(self, pid: int) -> float | None:
        """When the server reaped ``pid`` (its clock, right after the death)."""
        with self._cond:
            entry = self._exits.get(pid)
        return None if entry is None else entry[1]

    def describe_loss(self) -> str:
        """Why this server's workers are gone when the server itself died."""
        code = self._proc.poll()
        how = "still running" if code is None else describe_exit(code).split(". ")[0]
        return (
            f"nbaccel's fork server (pid {self.pid}), which started the ranks, {how}; the next "
            "launch starts a new one"
        )

    def forget(self, pid: int) -> None:
        with self._cond:
            self._exits.pop(pid, None)

    def close(self, grace: float = 1.0) -> None:
        """Stop the server (it kills its workers) and reap it; frees its pipes and thread.

        A server still importing torch cannot read its stdin yet: it is killed at once rather
        than waited for (the kernel's shutdown must not wait on an import).
        """
        self.release()
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        with self._cond:
            ready = self._ready
        try:
            self._proc.wait(grace if ready else 0.05)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(1.0)
        if not self._reader.is_alive():
            self._proc.stdout.close()
        self._listeners.clear()


def _worth_naming(module: str, named: list[str]) -> bool:
    """A top-level module the server imported that the launch summary names: a library, not
    the standard library's nor a private extension's (``_cython_3_3_0``)."""
    return not module.startswith("_") and is_candidate(module) and module not in named
