"""A fork server with torch preloaded: launches cost a fork, not an ``import torch``.

The server is a plain child process of the notebook kernel (``python -c ...``) that imports torch
and nbaccel's worker module once, then forks a fresh worker per request. The front that launches
adds its own modules to preload (the notebook's worker hooks, say): the server imports them once,
before the next fork. Because the server never
touches CUDA, forking it is safe even when the kernel has already initialised CUDA (the reason
fork-based launchers refuse to start after a notebook touched the GPU).

Protocol on the server's stdin/stdout pipes (private to the kernel): length-prefixed pickles of
tuples led by a :class:`~nbaccel.launch.protocol.ServerMessage`:
  driver -> server: (SPAWN, request_id, spec_bytes) | (PRELOAD, modules)
  server -> driver: (READY,) | (STARTED, request_id, pid) | (FAILED, request_id, why)
                    | (REFUSED, request_id, reason) | (EXITED, pid, returncode, at)
The server runs in a session of its own and ignores SIGINT: the notebook's stop button reaches
the ranks through the driver. When its stdin closes (the kernel closed it, or died), it kills its
workers and exits at once; SIGTERM does the same.
A module whose import initialises CUDA (a library doing ``torch.cuda.init()`` at import, or one
that torch's backend autoload pulls in) would leave every forked rank unable to use the GPU
("Cannot re-initialize CUDA in forked subprocess"): the server notices it after each import and
refuses to fork (REFUSED), naming the module and the fix (:class:`CudaInitializedInServer`).
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from nbaccel.launch.launchers.base import ProcessLauncher
from nbaccel.launch.launchers.reaper import Reaper, become_subreaper
from nbaccel.launch.processes import WorkerProcess, describe_exit
from nbaccel.launch.protocol import LaunchKind, ServerMessage
from nbaccel.launch.spec import WorkerSpec
from nbaccel.launch.transport import sweep_segments

__all__ = [
    "ENGINE_PRELOAD",
    "CudaInitializedInServer",
    "ForkServer",
    "ForkedServerProcess",
    "ProcessStartError",
    "ForkServerLauncher",
    "get_forkserver",
    "shutdown_forkserver",
    "warm_up",
    "warm_up_if_in_kernel",
]

_HEADER = struct.Struct("!I")


class ProcessStartError(RuntimeError):
    """The system refused to create a rank's process (process limit, memory)."""


#: What every server imports: torch and the rank side of the engine. Fronts add their own.
ENGINE_PRELOAD = ("torch", "torch.distributed", "nbaccel.launch.worker")


def _write_frame(fd: int, message: Any) -> None:
    data = pickle.dumps(message)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd: int, size: int) -> bytes:
    chunks = []
    while size:
        chunk = os.read(fd, size)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int) -> Any:
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size))
    return pickle.loads(_read_exact(fd, size))


# ----------------------------------------------------------------------------- server side
def _child_main(spec_bytes: bytes, server_fds: tuple[int, ...]) -> None:
    signal.set_wakeup_fd(-1)
    for fd in server_fds:
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    become_subreaper()  # what this rank starts stays below it (see launchers.reaper)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    code = 1
    try:
        from nbaccel.launch.worker import run_worker

        code = run_worker(pickle.loads(spec_bytes))
    finally:
        os._exit(code)


class CudaInitializedInServer(RuntimeError):
    """The fork server's process initialised CUDA (a preloaded module did it at import), so
    ranks forked from it could not use the GPU; raised before any rank starts."""


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def cuda_refusal(module: str) -> str:
    """Why the server refuses to fork once ``module``'s import initialised CUDA, and the fix."""
    return (
        f"importing {module!r} in nbaccel's fork server initialised CUDA, so ranks forked from "
        "it could not use the GPU (CUDA cannot be re-initialised in a forked child). Make that "
        "library initialise CUDA lazily (or import it inside the launched function, not at "
        "the top of a preloaded module), or pass start_method='spawn' to start each rank "
        "fresh."
    )


_cuda_culprit: str | None = None  # server side: the first module whose import initialised CUDA


def _preload(modules: Iterable[str], strict: bool) -> None:
    global _cuda_culprit
    for module in modules:
        try:
            __import__(module)
        except Exception as exc:
            if strict:
                raise
            # Preloading only saves time: the worker imports the module itself and fails there.
            print(f"[nbaccel] fork server could not preload {module}: {exc}", file=sys.stderr)
        if _cuda_culprit is None and _cuda_initialized():
            _cuda_culprit = module


def _fork_rank(request: tuple, stdout: int, server_fds: tuple[int, ...], reaper: Reaper) -> None:
    """Fork the rank a SPAWN request asks for and say so (or why the system refused)."""
    _, request_id, spec_bytes = request
    try:
        pid = os.fork()
    except OSError as exc:  # the process limit, or no memory for a new process
        why = f"{type(exc).__name__}: {exc}"
        _write_frame(stdout, (ServerMessage.FAILED, request_id, why))
        return
    if pid == 0:
        _child_main(spec_bytes, server_fds)
    reaper.ranks.add(pid)
    _write_frame(stdout, (ServerMessage.STARTED, request_id, pid))


def serve(preload: Iterable[str] = ENGINE_PRELOAD) -> None:
    """Run the fork server loop (called in the server process)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _preload(ENGINE_PRELOAD, strict=True)
    _preload(preload, strict=False)
    stdin, stdout = sys.stdin.fileno(), os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt the pipe
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    reaper = Reaper()

    def terminate(*_: Any) -> None:
        # SIGTERM (Jupyter shutting the kernel down signals its process group, then polls until
        # no child is left): end the workers and exit at once, without the interpreter's slow
        # teardown of torch, so the kernel's shutdown does not wait on this process.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        reaper.kill_all()
        os._exit(0)

    signal.signal(signal.SIGTERM, terminate)
    _write_frame(stdout, (ServerMessage.READY,))

    def reap() -> None:
        for pid, code in reaper.reap():
            _write_frame(stdout, (ServerMessage.EXITED, pid, code, time.time()))
        reaper.end_orphans()  # after the report: a rank's death is never held up by its orphans

    try:
        while True:
            due = reaper.next_due()
            wait = 1.0 if due is None else min(1.0, due + 0.01)
            ready, _, _ = select.select([stdin, wake_r], [], [], wait)
            if wake_r in ready:
                os.read(wake_r, 4096)
            reap()
            if stdin in ready:
                try:
                    request = _read_frame(stdin)
                except EOFError:
                    break
                if request[0] == ServerMessage.PRELOAD:
                    _preload(request[1], strict=False)
                    continue
                if _cuda_culprit is not None:
                    refusal = cuda_refusal(_cuda_culprit)
                    _write_frame(stdout, (ServerMessage.REFUSED, request[1], refusal))
                    continue
                _fork_rank(request, stdout, (wake_r, wake_w, stdout), reaper)
    finally:
        # stopping now: a late SIGTERM must not raise inside the interpreter's shutdown
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        reaper.kill_all()
        sys.stderr.flush()
        os._exit(0)  # no interpreter teardown of torch: the kernel may be waiting on this exit


# ----------------------------------------------------------------------------- driver side
class ForkedServerProcess:
    """The server forked from this process instead of started fresh: for a process that has
    imported torch already and started no thread yet (the remote agent), which saves a second
    ``import torch``. Offers what :class:`ForkServer` uses of a ``Popen``."""

    def __init__(self, preload: Iterable[str] = ()) -> None:
        to_server, from_driver = os.pipe()
        from_server, to_driver = os.pipe()
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
    """

    def __init__(self, preload: Iterable[str] = (), fork: bool = False) -> None:
        bootstrap = (  # the stop button (SIGINT to the process group) must not hit the imports
            "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
            "from nbaccel.launch.launchers.forkserver import serve; "
            "serve(json.loads(sys.argv[2]))"
        )
        self.preloaded = set(ENGINE_PRELOAD) | set(preload)
        if fork:
            self._proc: Any = ForkedServerProcess(sorted(preload))
        else:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    bootstrap,
                    json.dumps(sys.path),
                    json.dumps(sorted(preload)),
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
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name="nbaccel-fs")
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    def _read_loop(self) -> None:
        fd = self._proc.stdout.fileno()
        while True:
            try:
                message = _read_frame(fd)
            except (EOFError, OSError):
                break
            with self._cond:
                if message[0] == ServerMessage.READY:
                    self._ready = True
                elif message[0] == ServerMessage.STARTED:
                    self._started[message[1]] = message[2]
                elif message[0] in (ServerMessage.FAILED, ServerMessage.REFUSED):
                    self._started[message[1]] = (message[0], message[2])
                elif message[0] == ServerMessage.EXITED:
                    self._exits[message[1]] = (message[2], message[3])
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

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._ready:
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
                _write_frame(self._proc.stdin.fileno(), (ServerMessage.PRELOAD, missing))
            self.preloaded.update(missing)

    def spawn(self, spec_bytes: bytes) -> int:
        """Fork one worker running ``spec``; return its pid.

        Raises :class:`CudaInitializedInServer` when a preloaded module initialised CUDA."""
        self.wait_ready()
        with self._lock:
            request_id = self._next_id
            self._next_id += 1
            _write_frame(self._proc.stdin.fileno(), (ServerMessage.SPAWN, request_id, spec_bytes))
        with self._cond:
            while request_id not in self._started:
                if not self.alive():
                    raise RuntimeError("nbaccel's fork server exited while starting a worker")
                self._cond.wait(0.1)
            pid = self._started.pop(request_id)
        if isinstance(pid, tuple):
            kind, why = pid
            if kind == ServerMessage.REFUSED:
                raise CudaInitializedInServer(why)
            raise ProcessStartError(
                f"the system refused a new rank process ({why}): the process limit (ulimit -u, "
                "kernel.pid_max) or the memory is exhausted. Use fewer processes, or end "
                "processes that are no longer needed."
            )
        return pid

    def exitcode(self, pid: int) -> int | None:
        with self._cond:
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


_server: ForkServer | None = None
_server_lock = threading.Lock()


def get_forkserver(preload: Iterable[str] = ()) -> ForkServer:
    """The process-wide fork server, (re)started when needed, with ``preload`` imported."""
    global _server
    with _server_lock:
        if _server is None or not _server.alive():
            if _server is not None:
                _server.close()  # reap the dead one, close its pipes
            sweep_segments()  # a new kernel: reclaim the shared memory of dead ones
            _server = ForkServer(preload)
        else:
            _server.preload(preload)
        return _server


def warm_up(preload: Iterable[str] = ()) -> None:
    """Start the fork server now, so its ``import torch`` overlaps with the user's typing."""
    get_forkserver(preload)


def warm_up_if_in_kernel(preload: Iterable[str] = ()) -> None:
    """Warm the fork server when nbaccel is imported in a Jupyter kernel (not in workers)."""
    if os.environ.get("NBACCEL_LAUNCHER") or os.environ.get("NBACCEL_NO_WARMUP"):
        return
    if "ipykernel" not in sys.modules or not hasattr(os, "fork"):
        return
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None and type(shell).__name__ == "ZMQInteractiveShell":
        warm_up(preload)


class ForkServerLauncher(ProcessLauncher):
    """Fork each rank from the process-wide server (torch and ``preload`` already imported)."""

    name = LaunchKind.FORKSERVER

    def __init__(self, preload: Iterable[str] = ()) -> None:
        super().__init__(preload)
        self._server: ForkServer | None = None

    def prepare(self) -> None:
        self._server = get_forkserver(self.preload)

    def _current(self) -> ForkServer:
        if self._server is None or not self._server.alive():
            self._server = get_forkserver(self.preload)
        return self._server

    def start(self, spec: WorkerSpec) -> WorkerProcess:
        server = self._current()
        try:
            pid = server.spawn(pickle.dumps(spec))
        except CudaInitializedInServer:
            shutdown_forkserver()  # unusable for GPUs: the next launch starts a fresh server
            self._server = None
            raise
        return WorkerProcess(pid, self.name, server=server)

    def add_wakeup(self, callback: Callable[[], None]) -> None:
        self._current().add_wakeup(callback)

    def remove_wakeup(self, callback: Callable[[], None]) -> None:
        if self._server is not None:
            self._server.remove_wakeup(callback)


def shutdown_forkserver() -> None:
    """Stop and reap the process-wide fork server (at exit, or when asked)."""
    global _server
    with _server_lock:
        server, _server = _server, None
    if server is not None:
        server.close()


atexit.register(shutdown_forkserver)
