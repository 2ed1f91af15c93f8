"""A pool that outlives its kernel: ``%%distributed -n N --detach`` and ``%dist_attach``.

A detached pool's ranks belong to this user's supervisor (``nbaccel.launch.detached``): it
starts the pool's host process (:mod:`nbaccel.notebook.kernel.pool_host`), which holds an
ordinary pool. A kernel attaches to it over the pool folder's socket and gets a
:class:`DetachedPool`, which the magics use as they use the kernel's own pool: a cell is a call
sent to the host, whose output comes back live (lines, progress, memory, displays) through the
cell's renderer, then its values or the rank's exception. One kernel is attached at a time;
when it ends (killed, restarted, closed) the pool waits, with its names, for the next
``%dist_attach``, up to its idle time (``--detach_idle``).
"""

from __future__ import annotations

import os
import select
import socket
import sys
import time
from typing import Any

from nbaccel.launch.detached.client import request as supervisor_request
from nbaccel.launch.detached.folder import RunFolder
from nbaccel.launch.detached.pool_folder import PoolFolder, PoolInfo, find_pool, list_pools
from nbaccel.launch.detached.pool_link import connect
from nbaccel.launch.detached.replay import apply_record
from nbaccel.launch.driver.renderer import Renderer
from nbaccel.launch.request import LaunchRequest
from nbaccel.launch.wire.unpicklable import UnpicklableError
from nbaccel.notebook.kernel.cell_renderer import CellRenderer
from nbaccel.notebook.kernel.deferred_interrupt import DeferredInterrupt
from nbaccel.notebook.kernel.detached import RunList

__all__ = [
    "DetachedPool",
    "PoolEnded",
    "PoolList",
    "attach_detached_pool",
    "pools",
    "running_versions",
    "start_detached_pool",
    "stop_detached_pool",
    "versions_differ",
]

_HOST = "nbaccel.notebook.kernel.pool_host"
_HOST_START = 120.0  # s for a pool's host to listen (it imports torch on a loaded machine)
_END_WAIT = 60.0  # s for a shut-down pool's host to end its ranks and exit


class PoolEnded(RuntimeError):
    """The detached pool ended, or another kernel took it over, while this kernel held it."""


def running_versions() -> dict[str, str]:
    """The nbaccel and torch versions of this process (a pool and its kernel must agree)."""
    import torch

    import nbaccel

    return {"nbaccel": nbaccel.__version__, "torch": torch.__version__}


def versions_differ(pool: dict[str, str], kernel: dict[str, str]) -> tuple[str, str] | None:
    """``("nbaccel A with torch B", "nbaccel C with torch D")`` when they differ, else None."""
    if all(pool.get(name) == kernel.get(name) for name in ("nbaccel", "torch")):
        return None
    return tuple(  # type: ignore[return-value]
        f"nbaccel {v.get('nbaccel', '?')} with torch {v.get('torch', '?')}" for v in (pool, kernel)
    )


def _who(takeover: bool) -> dict[str, Any]:
    """What a kernel says of itself when it attaches (shown to a kernel it is refused to)."""
    kernel = ""
    try:
        from ipykernel import get_connection_file

        kernel = os.path.basename(get_connection_file())
    except Exception:  # not in a Jupyter kernel: a script or a terminal
        kernel = os.path.basename(sys.argv[0]) if sys.argv else ""
    return {"pid": os.getpid(), "host": socket.gethostname(), "kernel": kernel,
            "versions": running_versions(), "takeover": takeover}  # fmt: skip


class DetachedPool:
    """This kernel's hold on a detached pool (see the module docstring); built by
    :func:`start_detached_pool` or :func:`attach_detached_pool`."""

    detached = True

    def __init__(self, folder: PoolFolder, conn: Any, welcome: dict[str, Any]) -> None:
        self.folder = folder
        self.id = folder.id
        self.conn = conn
        self.num_processes = int(welcome["num_processes"])
        self.backend = welcome.get("backend")
        self.cpu = bool(welcome.get("cpu"))
        self.welcome = welcome
        self.closed = False
        self.labels: Any = None  # the ranks' labels, sent by the host when they change

    # ------------------------------------------------------------------ what the magics read
    @property
    def ranks(self) -> list[int]:
        return list(range(self.num_processes))

    @property
    def running(self) -> bool:
        return not self.closed

    @property
    def pids(self) -> dict[int, int]:
        return {int(r): p for r, p in self.info().rank_pids.items()}

    def info(self) -> PoolInfo:
        """The pool's ``pool.json`` as its host keeps it."""
        return self.folder.info()

    def describe(self) -> str:
        return f"{self.info().describe or self.welcome.get('describe', '')}, detached {self.id}"

    def serves(self, request: LaunchRequest) -> bool:
        """Whether a cell asking for ``request`` runs here (as ``Pool.serves``; ``--detach``
        is this pool's already)."""
        return (
            self.running
            and request.num_processes in (None, self.num_processes)
            and request.backend in (None, self.backend)
            and request.remote is None
            and (self.cpu or not request.cpu)
        )

    # ------------------------------------------------------------------ calls
    def _exchange(self, message: tuple, renderer: Renderer | None) -> Any:
        """Send ``message``; apply the host's renderer calls to ``renderer`` until its answer.
        The stop button (SIGINT) is passed on to the host's call."""
        __tracebackhide__ = True
        if self.closed:
            raise PoolEnded(f"this kernel no longer holds the detached pool {self.id}.")
        renderer = renderer or CellRenderer()
        if self.labels is not None:  # as a pool gives its group's labels to each renderer
            renderer.use_labels(self.labels)
        try:
            self.conn.send(message)
        except OSError as exc:
            raise self._lost() from exc
        except Exception as exc:  # the values of a push, a function that does not pickle
            raise UnpicklableError(f"could not send to the detached pool: {exc}") from exc
        sent = 0
        with DeferredInterrupt() as interrupt:
            while True:
                if interrupt.count > sent:
                    sent = interrupt.count
                    try:
                        self.conn.send(("interrupt",))
                    except OSError as exc:
                        raise self._lost() from exc
                if not self.conn.buffered() and not select.select([self.conn], [], [], 0.2)[0]:
                    continue
                try:
                    answer = self.conn.recv()
                except (EOFError, OSError) as exc:
                    raise self._lost() from exc
                if answer[0] == "record":
                    if answer[1][0] == "labels":
                        self.labels = answer[1][1]
                    apply_record(renderer, answer[1])
                elif answer[0] == "done":
                    return answer[1]
                else:  # ("raised", exception, its cause)
                    exc, cause = answer[1], answer[2]
                    if cause is not None:
                        exc.__cause__ = cause
                    raise exc

    def _lost(self) -> PoolEnded:
        """Why the host stopped answering: ended, or taken over by another kernel."""
        self.closed = True
        self.conn.close()
        try:
            holder = self.info().attached
        except OSError:
            return PoolEnded(
                f"the detached pool {self.id} has ended (shut down, its idle time passed, or "
                "`nbaccel pools stop`); names defined on its ranks are gone."
            )
        if holder and holder.get("since") != self.welcome.get("since"):  # another attach
            return PoolEnded(
                f"the detached pool {self.id} was taken over by kernel pid {holder.get('pid')} "
                f"on {holder.get('host')}: %dist_attach {self.id} --takeover to take it back."
            )
        return PoolEnded(f"the connection to the detached pool {self.id} was lost.")

    def call(
        self, function: Any, *args: Any, ranks: Any = None, timeout: float | None = None,
        renderer: Renderer | None = None, **kwargs: Any,
    ) -> dict[int, Any]:  # fmt: skip
        """Run ``function(*args, **kwargs)`` on ``ranks`` (default all); values by rank."""
        __tracebackhide__ = True
        targets = None if ranks is None else sorted(set(ranks))
        message = ("call", function, args, kwargs, targets, timeout, "")
        return self._exchange(message, renderer)

    def run_cell(
        self, source: str, ranks: Any = None, push: dict[str, Any] | None = None,
        timeout: float | None = None, filename: str = "<rank-cell>", first_line: int = 1,
        env: dict[str, str] | None = None, renderer: Renderer | None = None,
    ) -> dict[int, dict[str, Any] | None]:  # fmt: skip
        """Run ``source`` on ``ranks``; the display bundle of its last expression by rank."""
        __tracebackhide__ = True
        from nbaccel.notebook.rank import pool_worker

        if push:
            self.push(push, ranks=ranks, renderer=renderer)
        targets = None if ranks is None else sorted(set(ranks))
        head = next((line.strip() for line in source.splitlines() if line.strip()), "")
        message = ("call", pool_worker.run_cell, (source, filename, first_line, env), {},
                   targets, timeout, head or "(empty cell)")  # fmt: skip
        return self._exchange(message, renderer)

    def push(self, values: dict[str, Any], ranks: Any = None, renderer: Any = None) -> None:
        """Define ``values`` (name -> object) on ``ranks``."""
        __tracebackhide__ = True
        from nbaccel.notebook.kernel import pool_values

        pool_values.push(self, values, ranks, renderer)

    def pull(self, name: str, ranks: Any = None, renderer: Any = None) -> dict[int, Any]:
        """The value of ``name`` on each of ``ranks`` (default all)."""
        __tracebackhide__ = True
        from nbaccel.notebook.kernel import pool_values

        return pool_values.pull(self, name, ranks, renderer)

    def status(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        """One row per rank, as the host's pool sees it (``Pool.status``)."""
        return self._exchange(("status", timeout), None)

    def start(self, renderer: Renderer | None, notice: str) -> None:
        """Start the ranks (the host's pool), showing their start on ``renderer``."""
        self._exchange(("start", notice), renderer)

    def restart(self, renderer: Renderer | None = None, reason: str = "") -> None:
        """Restart the ranks with the same settings; names defined on them are lost."""
        self._exchange(("restart",), renderer)

    def shutdown(self) -> None:
        """End the pool now (every rank, its host; nothing left) and wait for its end."""
        host = self.info().host_pid if self.folder.path.exists() else None
        if not self.closed:
            try:
                self._exchange(("shutdown",), None)
            except PoolEnded:
                pass
            self.release()
        if not _wait_gone(self.folder, host, _END_WAIT / 2):
            _stop(self.folder, wait=True)

    def release(self) -> None:
        """Let go of the pool (the kernel ends, or attaches elsewhere): it goes on, waiting
        for the next attach."""
        if self.closed:
            return
        self.closed = True
        try:
            self.conn.send(("detach",))
        except OSError:
            pass
        self.conn.close()

    def __repr__(self) -> str:
        return f"<DetachedPool {self.id}: {self.num_processes} ranks>"


def _wait_gone(folder: PoolFolder, host: int | None, timeout: float = _END_WAIT) -> bool:
    """Wait until the pool's folder is removed and its host has exited; whether it did."""
    from nbaccel.launch.host.processes import pid_alive

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not folder.path.exists() and not (host and pid_alive(host)):
            return True
        time.sleep(0.1)
    return False


def _hello(folder: PoolFolder, takeover: bool) -> DetachedPool:
    """Connect to ``folder``'s host and attach (or be refused, RuntimeError saying why)."""
    conn = connect(folder.socket)
    try:
        conn.send(("hello", _who(takeover)))
        answer = conn.recv()
    except BaseException:
        conn.close()
        raise
    if answer[0] != "welcome":
        conn.close()
        raise RuntimeError(answer[1])
    return DetachedPool(folder, conn, answer[1])


def start_detached_pool(request: LaunchRequest, renderer: Renderer | None = None) -> DetachedPool:
    """Have this user's supervisor start a pool for ``request`` and attach to it (its start
    shows on ``renderer``). Local ranks only: refused with hosts or a launcher."""
    if request.remote is not None or request.hosts or request.launcher:
        raise ValueError(
            "a detached pool runs its ranks on this machine: --detach cannot be used with "
            "--hosts or --launcher (their agents belong to the kernel). Leave one of them out."
        )
    folder = PoolFolder.create()
    try:
        files = RunFolder(folder.path)
        files.write_pickle("request.pkl", request)
        files.write_json("launch.json", {
            "python": sys.executable, "env": dict(os.environ), "cwd": os.getcwd(),
            "sys_path": [p for p in sys.path if p], "entry": _HOST,
        })  # fmt: skip
        folder.update(idle=request.detach_idle, versions=running_versions())
        supervisor_request("pool-start", folder.path.parents[1], pool=folder.id)
        deadline = time.monotonic() + _HOST_START
        while True:
            try:
                pool = _hello(folder, takeover=False)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if not folder.path.exists() or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the detached pool's host process did not start (see "
                        f"{folder.path.parents[1] / 'supervisor.log'})."
                    ) from None
                time.sleep(0.1)
    except BaseException:
        if folder.path.exists():
            _stop(folder, wait=True)
            folder.remove()
        raise
    notice = (
        f"detached pool {pool.id}: it outlives this kernel. %dist_attach {pool.id} from any "
        f"kernel of this user; %dist_shutdown ends it; with no kernel attached it ends after "
        f"{request.detach_idle:g} s."
    )
    try:
        pool.start(renderer, notice)
    except BaseException:
        pool.shutdown()
        raise
    return pool


def attach_detached_pool(pool_id: str | None = None, takeover: bool = False) -> DetachedPool:
    """Attach this kernel to the detached pool ``pool_id`` (default: the newest). Refused,
    naming why, for an unknown id (with the pools that exist), a pool another kernel holds
    (unless ``takeover``) or one of other nbaccel/torch versions."""
    try:
        folder = find_pool(pool_id)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
    return _hello(folder, takeover)


def stop_detached_pool(pool_id: str, wait: bool = True) -> bool:
    """End the detached pool ``pool_id`` (``nbaccel pools stop``): its host ends its ranks;
    with ``wait``, until nothing of it is left. ValueError naming the pools for an unknown id."""
    try:
        folder = find_pool(pool_id)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
    return _stop(folder, wait)


def _stop(folder: PoolFolder, wait: bool) -> bool:
    """Ask the supervisor to stop ``folder``'s host (SIGTERM, then SIGKILL of its group);
    False when no supervisor holds it."""
    host = folder.info().host_pid if folder.path.exists() else None
    try:
        answer = supervisor_request("pool-stop", folder.path.parents[1], start=False,
                                    pool=folder.id)  # fmt: skip
    except (ConnectionError, RuntimeError, OSError):
        return False
    if wait:
        _wait_gone(folder, host)
    return bool(answer.get("stopping"))


class PoolList(RunList):
    """The pools of :func:`pools`: a list of ``PoolInfo``, shown as a table."""

    empty = "no detached pools"


def pools() -> PoolList:
    """This user's detached pools, oldest first: id, ranks, started, last cell, the kernel
    attached (or not), the ranks' memory, state."""
    return PoolList(list_pools())
