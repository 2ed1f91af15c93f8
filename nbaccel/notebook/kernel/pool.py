"""The persistent worker pool behind ``%%distributed`` (and a Python API for power users).

A :class:`Pool` is one :class:`~nbaccel.launch.driver.group.WorkerGroup` in "serve" mode: N
long-lived ranks with an initialised process group, started from the fork server. Cells, pushes
and pulls are calls on those ranks. The notebook's stop button, a ``timeout``, or a failing rank
leave the pool usable when the ranks come back to idle; a rank that does not (a peer blocked in a
collective, a crash) gets the pool restarted, with a message saying that names were lost.

    from nbaccel.notebook.kernel.pool import start_pool
    pool = start_pool(num_processes=2)
    pool.run_cell("import torch; x = torch.ones(1) * RANK", push={"RANK": 0})
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from nbaccel.launch.driver.group import WorkerGroup
from nbaccel.launch.driver.loop import POOL, CallState, run_call
from nbaccel.launch.driver.renderer import Renderer
from nbaccel.launch.host.ports import free_port
from nbaccel.launch.host.processes import describe_exit
from nbaccel.launch.plan import LaunchPlan
from nbaccel.launch.request import Front, LaunchRequest
from nbaccel.launch.wire.spec import Mode
from nbaccel.notebook.kernel import pool_status, pool_values
from nbaccel.notebook.kernel.cell_renderer import CellRenderer
from nbaccel.notebook.kernel.deferred_interrupt import DeferredInterrupt
from nbaccel.notebook.kernel.detached_pool import (
    DetachedPool,
    attach_detached_pool,
    start_detached_pool,
)
from nbaccel.notebook.preload import POOL_PRELOAD
from nbaccel.notebook.rank import pool_worker
from nbaccel.notebook.rank.instrumentation import worker_setup

__all__ = [
    "Pool",
    "PoolChangedError",
    "attach_pool",
    "get_pool",
    "release_pool",
    "shutdown_pool",
    "start_pool",
]

_MPL_BACKEND = "module://nbaccel.notebook.rank.mpl_backend"
# the options that say where a pool's ranks run (its hosts and how their agents start)
_HOST_OPTIONS = tuple(
    name for name in LaunchRequest.options(Front.REMOTE) if name != "num_processes"
)


class PoolChangedError(RuntimeError):
    """The pool was restarted or shut down (from another thread) while this call ran on it."""


class Pool:
    """``num_processes`` persistent ranks on this machine, one process group.

    Thread-safe: one call runs at a time; ``restart``/``shutdown`` from another thread during a
    call stop that call first (it raises :class:`PoolChangedError`), then change the pool, so
    no group of ranks is ever left without its pool.

    Args:
        request: what the pool is asked for (``%%distributed``'s options): ``num_processes``
            (default: ``LaunchPlan``'s pool default, one per GPU, else 2), ``backend``
            (default: nccl on GPUs, gloo on CPU), ``start_method``, ``cpu`` (CPU ranks even
            when GPUs are present; without GPUs a pool runs CPU ranks) and the hosts (one agent
            per host stays up with the pool). The options of a cell (``timeout``,
            ``mixed_precision``) are each call's.
    """

    def __init__(self, request: LaunchRequest | None = None) -> None:
        self.request = request or LaunchRequest()
        self.plan = LaunchPlan.create(
            Front.MAGIC, self.request, extra_env={"MPLBACKEND": _MPL_BACKEND}
        )
        self.remote = self.plan.remote
        self.num_processes = self.plan.num_processes
        self.backend = self.request.backend
        self.cpu = self.plan.cpu
        self.info: dict[int, dict[str, Any]] = {}
        self.group: WorkerGroup | None = None
        self.started_at: float | None = None
        self._interrupts = 0
        # lifecycle transitions (start, shutdown, restart, a call's start and end) hold the lock;
        # the thread running a call owns the group until the call ends
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._caller: int | None = None  # thread running a call
        self._ended_by: str | None = None  # what another thread did to the pool meanwhile

    # ------------------------------------------------------------------ lifecycle
    @property
    def ranks(self) -> list[int]:
        return list(range(self.num_processes))

    @property
    def pids(self) -> dict[int, int]:
        return self.group.pids if self.group is not None else {}

    @property
    def running(self) -> bool:
        return self.group is not None and not self.group.closed

    def describe(self) -> str:
        placed = self.plan.remote  # a Ray pool's hosts are known once placed
        if placed is not None and placed.layout is not None:
            return f"{self.plan.describe()} on {placed.layout.describe()}"
        return self.plan.describe()

    @property
    def effective_backend(self) -> str | None:
        """The process group's backend as the ranks reported it (None before they did)."""
        return self.backend or self.info.get(0, {}).get("backend")

    def serves(self, request: LaunchRequest) -> bool:
        """Whether this running pool can run what ``request`` asks for, so that it is kept.

        The one place that decides reuse: an option left out (``None``, ``cpu=False``) means
        "whatever the pool has"; a named backend matches the one the ranks use (``gloo`` is what
        a default CPU pool runs). How the ranks were started does not matter to a cell.
        """
        return (
            self.running
            and request.num_processes in (None, self.num_processes)
            and request.backend in (None, self.backend, self.effective_backend)
            and request.remote in (None, self.request.remote)  # as asked (Ray: before placing)
            and (self.cpu or not request.cpu)
            and not request.detach  # a detached pool is another pool: the supervisor's
        )

    def keeping(self, request: LaunchRequest) -> LaunchRequest:
        """``request`` with what it leaves out taken from this pool's: its number of ranks
        (unless new hosts bring their own), its backend, its hosts, CPU ranks."""
        kept: dict[str, Any] = {}
        if request.remote is None:
            if request.num_processes is None:
                kept["num_processes"] = self.num_processes
            if self.remote is not None:
                kept.update({name: getattr(self.request, name) for name in _HOST_OPTIONS})
        if request.backend is None and self.backend is not None:
            kept["backend"] = self.backend
        if self.cpu and not request.cpu:
            kept["cpu"] = True
        return dataclasses.replace(request, **kept) if kept else request

    def start(self, renderer: Renderer | None = None, timeout: float = 180.0) -> None:
        """Start the ranks and initialise their process group (once)."""
        with self._lock:
            self._start(renderer, timeout)

    def _start(self, renderer: Renderer | None, timeout: float) -> None:
        if self.running:
            return
        port, n, plan = free_port(), self.num_processes, self.plan
        self.info = {}
        group = WorkerGroup(
            n,
            lambda index: plan.rank_env(index, port),
            self._wrap(renderer),
            plan.make_launcher(POOL_PRELOAD),
            mode=Mode.SERVE,
            setup=[
                *worker_setup(memory=True),
                functools.partial(pool_worker.setup_worker, self.backend),
            ],
            local_rendezvous=plan.local_rendezvous,
        )
        self.group = group
        try:
            group.start(timeout)
            crashed = group.outcomes(0)
            if crashed or len(self.info) < n:
                why = "; ".join(
                    f"rank {r} {describe_exit(o.value)}" for r, o in sorted(crashed.items())
                )
                raise RuntimeError(
                    f"the pool of {self.describe()} could not start: "
                    + (why or f"not every rank was ready within {timeout:.0f} s")
                    + " (the ranks' output above says why)."
                )
        except BaseException:
            self._close_group()
            raise
        self.started_at = time.monotonic()  # %dist_status's uptime of remote ranks

    def _close_group(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()

    def _take_over(self, what: str) -> None:
        """Called with the lock held: when another thread runs a call, make it stop (it raises
        :class:`PoolChangedError` naming ``what``) and wait until it has let go of the group."""
        caller = self._caller
        if caller is None or caller == threading.get_ident():
            return
        self._ended_by = what
        group = self.group
        if group is not None:
            group.wake()
        self._idle.wait_for(lambda: self._caller is None)

    def shutdown(self) -> None:
        """Stop every rank (politely, then by signal) and free the pool's resources."""
        with self._lock:
            self._take_over("shut down")
            self._close_group()

    def release(self) -> None:
        """What this kernel's end does to its pool: :meth:`shutdown` (a detached one lets go)."""
        self.shutdown()

    def restart(self, renderer: Renderer | None = None, reason: str = "") -> None:
        """Stop the ranks and start fresh ones; names defined on the workers are lost."""
        with self._lock:
            self._take_over("restarted")
            renderer = renderer or (self.group.renderer if self.group else None)
            if reason:
                renderer.notice(
                    f"{reason}: restarting the pool; names defined on the ranks are lost."
                )
            if self.group is not None:
                self.group.stop(1.0)
            self._close_group()
            self._start(renderer, 180.0)

    def _wrap(self, renderer: Renderer | None) -> Renderer:
        if not isinstance(renderer, CellRenderer):
            renderer = CellRenderer(inner=renderer)
        renderer.on_info = self.info.__setitem__
        return renderer

    # ------------------------------------------------------------------ calls
    def call(
        self,
        function: Callable[..., Any],
        *args: Any,
        ranks: Iterable[int] | None = None,
        timeout: float | None = None,
        renderer: Renderer | None = None,
        **kwargs: Any,
    ) -> dict[int, Any]:
        """Run ``function(*args, **kwargs)`` on ``ranks`` (default all); values by rank.

        The first failure is raised as the original exception type naming the rank.
        """
        __tracebackhide__ = True
        group = self._begin_call(renderer)
        ended = None
        try:
            targets = self.ranks if ranks is None else sorted(set(ranks))
            with DeferredInterrupt() as interrupt:
                try:
                    call_id, targets = group.send_call(function, args, kwargs, ranks=targets)
                except (BrokenPipeError, ConnectionResetError):
                    group = self._lost_before_call(group)
                    call_id, targets = group.send_call(function, args, kwargs, ranks=targets)
                try:
                    stop = lambda: interrupt.count > 0 or self._ended_by is not None  # noqa: E731
                    report = run_call(group, call_id, targets, timeout, POOL, stop)
                finally:
                    group.release_shared()
            ended = self._ended_by
            if report.state != CallState.DONE and ended is None:
                self._recover(report, group.renderer)
        finally:
            with self._lock:
                self._caller = None
                self._ended_by = None
                self._idle.notify_all()
        if ended is not None:
            raise PoolChangedError(
                f"the pool was {ended} during this call (from another thread); the call did not "
                f"finish on rank(s) {report.late or targets}, and names defined on the ranks are "
                "lost."
            )
        exc = report.exception("the cell", others=True)
        if exc is not None:
            raise exc  # the rank's own exception, re-raised in the notebook
        return report.results()

    def _begin_call(self, renderer: Renderer | None) -> WorkerGroup:
        """Take the pool for a call on this thread (starting it, or restarting dead ranks)."""
        with self._lock:
            if self._caller is not None and self._caller != threading.get_ident():
                raise RuntimeError(
                    "the pool is running a call from another thread; wait for it to finish."
                )
            if not self.running:
                self._start(renderer, 180.0)
            group = self.group
            assert group is not None
            if renderer is not None:
                group.renderer = self._wrap(renderer)
            if not group.alive():
                dead = [r for r in self.ranks if r not in pool_status.alive_ranks(group)]
                self.restart(reason=f"rank(s) {dead} exited while idle")
                group = self.group
            self._caller = threading.get_ident()
            self._ended_by = None
            return group

    def _lost_before_call(self, group: WorkerGroup) -> WorkerGroup:
        """A rank ended just before the cell (its connection closed, its launcher has not said
        so yet): restart the pool, as for a rank that exited while idle; the new group."""
        group.release_shared()
        dead = [r for r in self.ranks if r not in pool_status.alive_ranks(group)]
        self.restart(reason=f"rank(s) {dead or 'of the pool'} ended before this cell")
        return self.group  # type: ignore[return-value]

    def _recover(self, report: Any, renderer: Renderer) -> None:
        """After an unfinished call: restart the pool when ranks are stuck or gone."""
        if report.stuck or report.crashed:
            if report.stuck and report.deaf == report.stuck:
                what = f"rank(s) {report.stuck} ignore SIGINT, which the stop button sends"
            elif report.stuck:
                what = (
                    f"rank(s) {report.stuck} did not stop within {POOL.recover:.0f} s (blocked "
                    "in a collective?)"
                )
            else:
                what = f"rank(s) {report.crashed} ended"
            self.restart(renderer, reason=what)
        elif report.state == CallState.INTERRUPTED:
            renderer.notice(
                f"interrupted the cell on rank(s) {report.targets}; the pool and its names are "
                "kept."
            )

    # ------------------------------------------------------------------ cells and names
    def run_cell(
        self,
        source: str,
        ranks: Iterable[int] | None = None,
        push: dict[str, Any] | None = None,
        timeout: float | None = None,
        filename: str = "<rank-cell>",
        first_line: int = 1,
        env: dict[str, str] | None = None,
        renderer: Renderer | None = None,
    ) -> dict[int, dict[str, Any] | None]:
        """Run ``source`` on ``ranks``; the display bundle of its last expression by rank."""
        __tracebackhide__ = True
        if push:
            self.push(push, ranks=ranks, renderer=renderer)
        cell = (source, filename, first_line, env)
        return self.call(
            pool_worker.run_cell, *cell, ranks=ranks, timeout=timeout, renderer=renderer
        )

    def push(
        self,
        values: dict[str, Any],
        ranks: Iterable[int] | None = None,
        renderer: Renderer | None = None,
    ) -> None:
        """Define ``values`` (name -> object) on ``ranks``; large CPU tensors via shared memory."""
        __tracebackhide__ = True
        pool_values.push(self, values, ranks, renderer)

    def pull(
        self, name: str, ranks: Iterable[int] | None = None, renderer: Renderer | None = None
    ) -> dict[int, Any]:
        """The value of ``name`` on each of ``ranks`` (default all)."""
        __tracebackhide__ = True
        return pool_values.pull(self, name, ranks, renderer)

    def status(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        """One row per rank: pid, device, memory, state (idle/busy/exited), uptime (see
        :func:`~nbaccel.notebook.kernel.pool_status.status_rows`)."""
        return pool_status.status_rows(self, timeout)


class _Registry:
    """The kernel's one pool (its own, or a detached one it is attached to), and the lock that
    guards starting and stopping it (start_pool / shutdown_pool from several threads)."""

    def __init__(self) -> None:
        self.pool: Pool | DetachedPool | None = None
        self.lock = threading.RLock()


_registry = _Registry()


def get_pool() -> Pool | DetachedPool | None:
    """The pool started by ``%%distributed`` or :func:`start_pool` (or attached with
    :func:`attach_pool`), or None."""
    pool = _registry.pool
    return pool if pool is not None and pool.running else None


def start_pool(
    request: LaunchRequest | None = None, renderer: Renderer | None = None, **options: Any
) -> Pool | DetachedPool:
    """The running pool when it can serve ``request`` (:meth:`Pool.serves`), else a new one
    (the old one is shut down, with a notice on ``renderer``). What the request leaves out
    keeps the running pool's value (:meth:`Pool.keeping`), else takes the plan's default.
    ``detach=True`` starts a pool under this user's supervisor, which outlives the kernel
    (:mod:`~nbaccel.notebook.kernel.detached_pool`); an attached detached pool is never
    replaced by a cell that asks for another one (it is refused, naming the fix).

    Without a request, ``options`` are its keywords: ``start_pool(num_processes=2)``.
    """
    if request is None:
        request = LaunchRequest.create(Front.MAGIC, **options)
    elif options:
        raise TypeError(f"pass either a LaunchRequest or its options, not both: {sorted(options)}")
    with _registry.lock:
        current = get_pool()
        if current is not None and current.serves(request):
            if renderer is not None:
                renderer.start("", current.num_processes)
            return current
        if isinstance(current, DetachedPool):
            raise ValueError(
                f"this kernel is attached to the detached pool {current.id} "
                f"({current.num_processes} ranks, backend {current.backend or 'default'}), "
                "which this cell's options do not fit: leave them out to run on it, or end it "
                "first with %dist_shutdown (its names are lost)."
            )
        if current is not None:  # what is not asked for stays as it is
            request = current.keeping(request)
        if request.detach:
            if current is not None:
                if renderer is not None:
                    renderer.notice("stopping this kernel's pool for a detached one; names "
                                    "defined on its ranks are lost.")  # fmt: skip
                current.shutdown()
            _registry.pool = None
            _registry.pool = start_detached_pool(request, renderer)
            return _registry.pool
        pool = Pool(request)
        if current is not None:  # the new settings are valid: only now stop the running pool
            if renderer is not None:
                placed = pool.plan.remote
                where = f" on {placed.layout.describe()}" if placed and placed.layout else ""
                renderer.notice(
                    f"restarting the pool ({current.num_processes} -> {pool.num_processes} "
                    f"processes{where}, backend {current.effective_backend or 'default'} -> "
                    f"{pool.backend or 'default'}); names defined on the ranks are lost."
                )
            current.shutdown()
        if renderer is not None:
            where = pool.plan.make_launcher().describe()
            renderer.start(pool.plan.announcement(where), pool.num_processes)
        pool.start(renderer)
        _registry.pool = pool
        return pool


def shutdown_pool() -> bool:
    """Stop the pool (a detached one too: it ends); False when none was running."""
    with _registry.lock:
        pool, _registry.pool = _registry.pool, None
        if pool is None or not pool.running:
            return False
        pool.shutdown()
        return True


def release_pool() -> None:
    """What the kernel's end does: stop its own pool, let go of a detached one (which waits
    for the next attach)."""
    with _registry.lock:
        pool, _registry.pool = _registry.pool, None
        if pool is not None:
            pool.release()


def attach_pool(pool_id: str | None = None, takeover: bool = False) -> DetachedPool:
    """Make the detached pool ``pool_id`` (default: the newest) this kernel's pool, names
    intact. Refused, saying why, when this kernel runs a pool of its own, when another kernel
    holds the pool (``takeover=True`` takes it), for an unknown id (naming the pools), or when
    the pool runs other nbaccel/torch versions."""
    with _registry.lock:
        current = get_pool()
        if isinstance(current, Pool):
            raise ValueError(
                f"this kernel runs its own pool ({current.num_processes} ranks): end it with "
                "%dist_shutdown first (its names are lost), or attach from another kernel."
            )
        if current is not None and (pool_id is None or current.id.startswith(pool_id)):
            return current
        pool = attach_detached_pool(pool_id, takeover)
        if current is not None:
            current.release()
        _registry.pool = pool
        return pool
