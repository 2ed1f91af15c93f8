"""The host of a detached pool: ``python -m nbaccel.notebook.kernel.pool_host FOLDER``.

This user's supervisor starts it (with the starting kernel's interpreter, environment and
working directory, ``launch.json``), so the pool's ranks and process group belong to the
supervisor, not to a kernel. It holds an ordinary :class:`~nbaccel.notebook.kernel.pool.Pool`
and serves one attached kernel at a time on the pool folder's socket
(:mod:`nbaccel.launch.detached.pool_link`: 0600 in a 0700 folder, the peer's uid checked before
anything is read): the kernel sends calls, the host runs them on the pool and sends back every
renderer call as it happens (:class:`~nbaccel.launch.detached.recorder.RelayRenderer`), then the
values by rank or the exception.

The main thread accepts kernels, reads what they send (a second kernel is refused, naming the
one attached, unless it takes over) and runs each call as soon as it has read it: no hand-off
between threads on a cell's path. While a call runs, a watcher thread reads in its place (the
stop button, a kernel that goes away or takes over); the two share one selector and read under
one lock, each reading only what is there to read. The stop button in the kernel reaches the
call as it reaches a kernel's own pool (SIGINT, counted by the call). A kernel that goes away
mid-call has that call interrupted. With no kernel attached for the pool's idle time
(``--detach_idle``), on SIGTERM (``nbaccel pools stop``), on ``%dist_shutdown``, or when the
supervisor's pipe (stdin) closes, the host ends its ranks, removes the pool's folder and exits.
A rank that ends while no kernel is attached is written
into ``pool.json`` and said to the next kernel that attaches.
"""

from __future__ import annotations

import os
import pickle
import select
import selectors
import signal
import socket
import sys
import threading
import time
from collections import deque
from typing import Any

from nbaccel.launch.detached.folder import RunFolder
from nbaccel.launch.detached.pool_folder import PoolFolder
from nbaccel.launch.detached.pool_link import accept, listen
from nbaccel.launch.detached.recorder import RelayRenderer
from nbaccel.launch.driver.renderer import Renderer
from nbaccel.launch.wire.channel import Connection
from nbaccel.launch.wire.labels import RankLabels
from nbaccel.launch.wire.protocol import EventKind
from nbaccel.notebook.kernel import pool_status
from nbaccel.notebook.kernel.detached_pool import running_versions, versions_differ
from nbaccel.notebook.kernel.pool import Pool

__all__ = ["PoolHost", "main"]

_TICK = 0.5  # s between the main thread's looks at the idle time and the ranks


class _Kernel:
    """One kernel's connection, and who it is (``pid``, ``host``, ``kernel``, ``since``)."""

    def __init__(self, conn: Connection, who: dict[str, Any]) -> None:
        self.conn = conn
        self.who = who
        self.lock = threading.Lock()
        self.closed = False
        self.labels: Any = None  # the rank labels this kernel has (sent again only when changed)

    def send(self, message: tuple) -> None:
        """Send ``message``; nothing when the kernel is gone (its output is lost, not the pool)."""
        with self.lock:
            if self.closed:
                return
            try:
                self.conn.send(message)
            except OSError:
                self.close()

    def close(self) -> None:
        self.closed = True
        try:
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.conn.close()


class _KernelRelay(RelayRenderer):
    """The pool's renderer while a kernel is attached: its calls go to that kernel, display
    bundles as display events (the kernel shows them as its own pool's cell would). The rank
    labels, given at every call, go only when they changed: the kernel keeps them and gives
    them to each cell's renderer, so an empty cell's whole answer is one message."""

    def __init__(self, kernel: _Kernel) -> None:
        super().__init__(lambda record: kernel.send(("record", record)))
        self.kernel = kernel

    def use_labels(self, labels: RankLabels) -> None:
        Renderer.use_labels(self, labels)
        if labels != self.kernel.labels:
            self.kernel.labels = labels
            self.write(("labels", labels))

    def display(self, rank: int, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        self.write(("event", rank, str(EventKind.DISPLAY), {"data": data, "metadata": metadata}))


class PoolHost:
    """Serves the pool of ``folder`` (see the module docstring)."""

    def __init__(self, folder: PoolFolder) -> None:
        self.folder = folder
        self.request = RunFolder(folder.path).read_pickle("request.pkl")
        self.pool = Pool(self.request)
        self.versions = running_versions()
        self.lock = threading.Lock()  # the attached kernel, pool.json
        self.kernel: _Kernel | None = None
        self.calling: _Kernel | None = None  # whose call runs now
        self.calls: deque[tuple[_Kernel, tuple]] = deque()  # read, not yet run (main thread's)
        self.read_lock = threading.Lock()  # held while a thread reads a socket or (un)registers
        self.watching = threading.Event()  # set while a call runs: the watcher reads
        self.ending: str | None = None
        self.detached_since = time.time()
        self.lost = ""  # said to the next kernel that attaches; pool.json has it too
        self.rank_pids: dict[str, int] = {}
        self.state = "starting"
        self.later: dict[str, Any] = {}  # pool.json changes written at the next tick
        self.listener = listen(folder.socket)
        self.selector = selectors.DefaultSelector()  # the listener and the kernels
        self.selector.register(self.listener, selectors.EVENT_READ, None)
        self._update(
            host_pid=os.getpid(), versions=self.versions, idle=self.request.detach_idle,
            num_processes=self.pool.num_processes, describe=self.pool.describe(),
        )  # fmt: skip

    def _update(self, **changes: Any) -> None:
        with self.lock:
            self.folder.update(**changes)

    def end(self, why: str) -> None:
        """End the pool once the call running now (interrupted) is over."""
        self.ending = self.ending or why
        if self.calling is not None:
            os.kill(os.getpid(), signal.SIGINT)

    # ------------------------------------------------------------------ reading
    def _read(self, ready: list[tuple[selectors.SelectorKey, int]]) -> None:
        """Handle what the sockets of ``ready`` hold now (the caller holds ``read_lock``):
        accept a kernel, or read its messages; calls go to ``calls`` for the main thread. The
        other thread may have read a socket since the selector said so: only what is there is
        read."""
        for key, _ in ready:
            if key.data is None:
                if _waiting(self.listener):
                    self._accept()
                continue
            kernel: _Kernel = key.data
            while not kernel.closed and (kernel.conn.buffered() or _waiting(kernel.conn.sock)):
                try:
                    message = kernel.conn.recv()
                except (EOFError, OSError, pickle.UnpicklingError):
                    message = ("detach",)
                self._handle(kernel, message)

    def _accept(self) -> None:
        try:
            conn = accept(self.listener)
        except OSError:  # another user (refused unread), or gone already
            return
        self.selector.register(conn.sock, selectors.EVENT_READ, _Kernel(conn, {}))

    def _handle(self, kernel: _Kernel, message: tuple) -> None:
        if message[0] == "detach" or kernel.closed:
            self._forget(kernel)
            self._drop(kernel)
        elif message[0] == "hello":
            self._hello(kernel, message[1])
        elif message[0] == "interrupt":
            if self.calling is kernel:
                os.kill(os.getpid(), signal.SIGINT)
        elif kernel is not self.kernel:
            taken = RuntimeError(
                "this kernel no longer holds the pool (another took it "
                "over): %dist_attach --takeover to take it back"
            )
            kernel.send(("raised", taken, None))
        else:
            self.calls.append((kernel, message))

    def watch(self) -> None:
        """While a call runs, read in the main thread's place (runs on its own thread)."""
        try:
            while self.ending is None:
                if not self.watching.wait(_TICK):
                    continue
                ready = self.selector.select(timeout=_TICK)
                with self.read_lock:
                    if ready and self.watching.is_set():
                        self._read(ready)
        except (OSError, ValueError):  # the selector was closed: the pool ended
            return

    def _forget(self, kernel: _Kernel) -> None:
        """Stop reading ``kernel`` and close its connection."""
        try:
            self.selector.unregister(kernel.conn.sock)
        except (KeyError, ValueError):
            pass
        kernel.close()

    def _hello(self, kernel: _Kernel, who: dict[str, Any]) -> None:
        pool_id = self.folder.id
        differ = versions_differ(self.versions, who.get("versions", {}))
        if differ:
            kernel.send(
                (
                    "refused",
                    f"pool {pool_id} runs {differ[0]}; this kernel has "
                    f"{differ[1]}: attach from an environment with the pool's versions, "
                    f"or end the pool (nbaccel pools stop {pool_id}) and start a new one.",
                )
            )
            return  # fmt: skip
        old = self.kernel
        if old is not None and not old.closed and not who.get("takeover"):
            since = time.strftime("%H:%M:%S", time.localtime(old.who.get("since", 0)))
            kernel.send(
                (
                    "refused",
                    f"pool {pool_id} is attached to kernel pid "
                    f"{old.who.get('pid')} on {old.who.get('host')} "
                    f"({old.who.get('kernel') or 'no kernel id'}) since {since}: end or "
                    f"detach that kernel, or take the pool over with %dist_attach {pool_id} "
                    "--takeover (that kernel's next cell is refused).",
                )
            )
            return  # fmt: skip
        kernel.who = {**who, "since": time.time()}
        self.kernel = kernel
        # the new holder is on record before the old kernel's connection closes: the old kernel
        # reads it to say who took the pool over
        self._update(attached={k: kernel.who.get(k) for k in ("pid", "host", "kernel", "since")},
                     detached_since=None)  # fmt: skip
        if old is not None:
            if self.calling is old:
                os.kill(os.getpid(), signal.SIGINT)  # its running cell stops: the pool is taken
            self._forget(old)
        info = self.folder.info()
        kernel.send(("welcome", {
            "id": pool_id, "num_processes": self.pool.num_processes, "describe": info.describe,
            "backend": self.pool.backend, "cpu": self.pool.cpu, "started": info.started,
            "running": self.pool.running, "lost": self.lost, "last_cell": info.last_cell,
            "taken_from": old.who if old is not None else None, "since": kernel.who["since"],
        }))  # fmt: skip

    def _drop(self, kernel: _Kernel) -> None:
        kernel.close()
        if kernel is self.kernel:
            self.kernel = None
            self.detached_since = time.time()
            self._update(attached=None, detached_since=self.detached_since)
            if self.calling is kernel:  # its kernel went away mid-cell: stop the cell
                os.kill(os.getpid(), signal.SIGINT)

    # ------------------------------------------------------------------ the main thread
    def serve(self) -> None:
        """Read the kernels and run their calls until the pool ends; then end the ranks and
        tidy up."""
        watcher = threading.Thread(target=self.watch, name="nbaccel-pool-watcher", daemon=True)
        watcher.start()
        ticked = time.monotonic()
        try:
            while self.ending is None:
                if self.calls:
                    self._run(*self.calls.popleft())
                    continue
                ready = self.selector.select(timeout=_TICK)
                if ready:
                    with self.read_lock:
                        self._read(ready)
                if time.monotonic() - ticked >= _TICK:
                    ticked = time.monotonic()
                    self._tick()
        finally:
            self.ending = self.ending or "its host ended"
            self.watching.set()  # the watcher sees the end
            self.pool.shutdown()
            if self.kernel is not None:
                self.kernel.close()
            with self.read_lock:
                self.selector.close()
            self.listener.close()
            self.folder.remove()

    def _tick(self) -> None:
        if self.later:  # off a cell's path: the last cell, the ranks' pids
            changes, self.later = self.later, {}
            self._update(**changes)
        if self.kernel is not None or not self.pool.running:
            return
        if time.time() - self.detached_since > self.request.detach_idle:
            self.ending = f"no kernel attached for {self.request.detach_idle:g} s"
            return
        group = self.pool.group
        if group is not None and not self.lost:
            dead = [r for r in self.pool.ranks if r not in pool_status.alive_ranks(group)]
            if dead:
                when = time.strftime("%H:%M:%S")
                self.lost = (
                    f"rank(s) {dead} ended at {when} while no kernel was attached (pids "
                    + ", ".join(str(self.pool.pids.get(r)) for r in dead)
                    + "); the next cell restarts the pool: names defined on the ranks are lost."
                )
                self._update(lost=self.lost)

    def _run(self, kernel: _Kernel, message: tuple) -> None:
        kind = message[0]
        relay = _KernelRelay(kernel)
        self.calling = kernel
        self.watching.set()
        try:
            if kind == "start":
                self.pool.start(relay)
                relay.notice(message[1])
                answer: Any = None
            elif kind == "call":
                _, function, args, kwargs, ranks, timeout, first_line = message
                if self.lost:  # before the group may have seen the rank end
                    self.pool.restart(relay, reason="ranks ended while no kernel was attached")
                answer = self.pool.call(function, *args, ranks=ranks, timeout=timeout,
                                        renderer=relay, **kwargs)  # fmt: skip
                if first_line:
                    self.later.update(last_cell=first_line[:80], last_cell_at=time.time())
            elif kind == "status":
                answer = self.pool.status(message[1])
            elif kind == "restart":
                self.pool.restart(relay)
                answer = None
            elif kind == "shutdown":
                self.ending = "shut down from a kernel"
                self.pool.shutdown()
                answer = None
            else:
                raise ValueError(f"a detached pool does not know {kind!r}")
        except BaseException as exc:  # the rank's exception, or the pool's: to the kernel
            self.calling = None
            self.watching.clear()
            kernel.send(("raised", _sendable(exc), _sendable(exc.__cause__)))
            self._after_call()
            return
        self.calling = None
        self.watching.clear()
        self._after_call()
        try:
            kernel.send(("done", answer))
        except Exception as exc:  # a value that cannot be pickled to the kernel
            kernel.send(("raised", RuntimeError(f"the value could not be sent to the kernel: "
                                                f"{type(exc).__name__}: {exc}"), None))  # fmt: skip

    def _after_call(self) -> None:
        """Keep ``pool.json``'s ranks current (rarely changes: a start or restart, written now;
        the last cell waits for the next tick, off the cell's path)."""
        pids = {str(rank): pid for rank, pid in self.pool.pids.items()}
        state = "running" if self.pool.running else "starting"
        if pids != self.rank_pids or state != self.state:  # a restart replaced any lost rank
            self.rank_pids, self.state, self.lost = pids, state, ""
            self._update(rank_pids=pids, state=state, lost="")


def _waiting(sock: socket.socket) -> bool:
    """Whether ``sock`` has something to read now (a message, a connection, its end)."""
    return bool(select.select([sock], [], [], 0)[0])


def _sendable(exc: BaseException | None) -> BaseException | None:
    """``exc`` when it pickles, else a RuntimeError with its type and text."""
    if exc is None:
        return None
    import cloudpickle

    try:
        cloudpickle.dumps(exc)
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _watch_supervisor(host: PoolHost) -> None:
    """End the pool when the supervisor's pipe (our stdin) closes."""
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    host.end("its supervisor ended")


def main(argv: list[str] | None = None) -> int:
    """Entry point: serve the pool of the folder given as the only argument."""
    argv = sys.argv[1:] if argv is None else argv
    folder = PoolFolder(argv[0])
    launch = RunFolder(folder.path).read_json("launch.json")
    for entry in reversed(launch.get("sys_path", [])):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    signal.signal(signal.SIGINT, lambda signum, frame: None)  # counted by a running call only
    try:
        host = PoolHost(folder)
    except BaseException:
        folder.remove()
        raise
    signal.signal(signal.SIGTERM, lambda signum, frame: host.end("stopped"))
    threading.Thread(target=_watch_supervisor, args=(host,), daemon=True).start()
    host.serve()
    print(f"nbaccel pool {folder.id} ended: {host.ending}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
