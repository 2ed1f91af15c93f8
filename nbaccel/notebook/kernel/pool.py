"""The persistent worker pool behind ``%%distributed`` (and a Python API for power users).

A :class:`Pool` is one :class:`~nbaccel.launch.group.WorkerGroup` in "serve" mode: N long-lived
ranks with an initialised process group, started from the fork server. Cells, pushes and pulls
are calls on those ranks. The notebook's stop button, a ``timeout``, or a failing rank leave the
pool usable when the ranks come back to idle; a rank that does not (a peer blocked in a
collective, a crash) gets the pool restarted, with a message saying that names were lost.

    from nbaccel.notebook.kernel.pool import start_pool
    pool = start_pool(2)
    pool.run_cell("import torch; x = torch.ones(1) * RANK", push={"RANK": 0})
"""

from __future__ import annotations

import functools
import signal
import time
from collections.abc import Callable, Iterable
from typing import Any

import psutil
import torch

from nbaccel.launch.errors import LaunchTimeout, RankCrashed, rebuild_exception
from nbaccel.launch.group import Outcome, WorkerGroup
from nbaccel.launch.plan import LaunchPlan, free_port, resolve_start_method, worker_hooks
from nbaccel.launch.processes import describe_exit
from nbaccel.launch.render import Renderer
from nbaccel.launch.transport import UnpicklableError, pack
from nbaccel.notebook.kernel.deferred_interrupt import DeferredInterrupt
from nbaccel.notebook.rank import pool_worker

__all__ = ["Pool", "get_pool", "shutdown_pool", "start_pool"]

_SETTLE_INTERRUPT = 1.0  # s the ranks get to report an interrupt they received themselves
_SETTLE_FAILURE = 0.5  # s the other ranks get to finish after a peer failed
_RECOVER = 3.0  # s after our SIGINT before the pool is restarted
_MPL_BACKEND = "module://nbaccel.notebook.rank.mpl_backend"


class Pool:
    """``num_processes`` persistent ranks on this machine, one process group.

    Args:
        num_processes: number of ranks.
        backend: process-group backend (default: nccl on GPUs, gloo on CPU).
        start_method: "auto" (fork server with torch preloaded), "spawn" or "fork".
        cpu: CPU ranks even when GPUs are present (default: CPU when there is no GPU).
    """

    def __init__(
        self,
        num_processes: int,
        backend: str | None = None,
        start_method: str = "auto",
        cpu: bool | None = None,
    ) -> None:
        if not isinstance(num_processes, int) or num_processes < 1:
            raise ValueError(f"num_processes must be a positive integer, got {num_processes!r}.")
        gpus = torch.cuda.device_count()
        self.cpu = gpus == 0 if cpu is None else cpu
        if not self.cpu and num_processes > gpus:
            raise ValueError(
                f"num_processes={num_processes} but this machine has {gpus} GPU(s); use at most "
                f"{gpus}."
            )
        self.num_processes = num_processes
        self.backend = backend
        self.start_method = resolve_start_method(start_method)
        self.info: dict[int, dict[str, Any]] = {}
        self.group: WorkerGroup | None = None
        self.started_at: float | None = None
        self._interrupts = 0

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
        if self.cpu:
            what = f"{self.num_processes} CPU process{'es' if self.num_processes > 1 else ''}"
        else:
            what = f"{self.num_processes} GPU{'s' if self.num_processes > 1 else ''}"
        return f"{what} ({self.backend or ('gloo' if self.cpu else 'nccl')})"

    def start(self, renderer: Renderer | None = None, timeout: float = 180.0) -> None:
        """Start the ranks and initialise their process group (once)."""
        if self.running:
            return
        port, n = free_port(), self.num_processes
        plan = LaunchPlan(n, cpu=self.cpu, launcher="pool")

        def env(index: int) -> dict[str, str]:
            return {**plan.rank_env(index, port), "MPLBACKEND": _MPL_BACKEND}

        self.info = {}
        group = WorkerGroup(
            n,
            env,
            self._wrap(renderer),
            start_method=self.start_method,
            mode="serve",
            setup=[
                *worker_hooks(memory=True),
                functools.partial(pool_worker.setup_worker, self.backend),
            ],
            local_rendezvous=True,
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
            self.shutdown()
            raise
        self.started_at = time.time()

    def shutdown(self) -> None:
        """Stop every rank (politely, then by signal) and free the pool's resources."""
        group, self.group = self.group, None
        if group is not None:
            group.close()

    def restart(self, renderer: Renderer | None = None, reason: str = "") -> None:
        """Stop the ranks and start fresh ones; names defined on the workers are lost."""
        renderer = renderer or (self.group.renderer if self.group else None)
        if reason:
            renderer.notice(f"{reason}: restarting the pool; names defined on the ranks are lost.")
        if self.group is not None:
            self.group.stop(1.0)
        self.shutdown()
        self.start(renderer)

    def _wrap(self, renderer: Renderer | None) -> Renderer:
        from nbaccel.notebook.kernel.rank_output import CellRenderer

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
        if not self.running:
            self.start(renderer)
        group = self.group
        assert group is not None
        if renderer is not None:
            group.renderer = self._wrap(renderer)
        if not group.alive():
            dead = [r for r in self.ranks if r not in _alive_ranks(group)]
            self.restart(reason=f"rank(s) {dead} exited while idle")
            group = self.group
        targets = self.ranks if ranks is None else sorted(set(ranks))
        with DeferredInterrupt() as interrupt:
            call_id, targets = group.send_call(function, args, kwargs, ranks=targets)
            try:
                state = self._wait(call_id, targets, timeout, interrupt)
                if state != "done":
                    self._settle(call_id, targets, state)
            finally:
                group.release_shared()
        outcomes = group.outcomes(call_id, targets)
        if state == "interrupted":
            raise KeyboardInterrupt
        if state == "timeout":
            late = [r for r in targets if r not in outcomes or outcomes[r].kind != "result"]
            raise LaunchTimeout(
                f"the cell ran longer than timeout={timeout} s on rank(s) {late}; "
                "they were interrupted."
            )
        failure = _first_failure(outcomes)
        if failure is not None:
            exc = _as_exception(*failure, outcomes)
            exc.rank_results = {r: o.value for r, o in outcomes.items() if o.kind == "result"}
            raise exc
        return {rank: outcome.value for rank, outcome in sorted(outcomes.items())}

    def _wait(
        self, call_id: int, targets: list[int], timeout: float | None, interrupt: DeferredInterrupt
    ) -> str:
        group = self.group
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            got = group.outcomes(call_id, targets)
            if interrupt.count or any(_interrupted(o) for o in got.values()):
                return "interrupted"  # the stop button (workers usually got the SIGINT too)
            if any(o.kind != "result" for o in got.values()):
                return "failed"
            if len(got) == len(targets):
                return "done"
            wait = 0.2
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    return "timeout"
            group.pump(wait)

    def _settle(self, call_id: int, targets: list[int], state: str) -> None:
        """Bring the ranks of an unfinished call back to idle: wait, SIGINT, else restart."""
        group = self.group

        def pending() -> list[int]:
            got = group.outcomes(call_id, targets)
            return [r for r in targets if r not in got]

        first = {"interrupted": _SETTLE_INTERRUPT, "failed": _SETTLE_FAILURE}.get(state, 0.0)
        group.pump_until(lambda: not pending(), first)
        if pending():
            group.signal_all(signal.SIGINT, pending())
            group.pump_until(lambda: not pending(), _RECOVER)
        crashed = [r for r, o in group.outcomes(call_id, targets).items() if o.kind == "crash"]
        stuck = pending()
        if stuck or crashed:
            what = (
                f"rank(s) {stuck} did not stop within {_RECOVER:.0f} s (blocked in a collective?)"
                if stuck
                else f"rank(s) {crashed} ended"
            )
            self.restart(group.renderer, reason=what)
        elif state == "interrupted":
            group.renderer.notice(
                f"interrupted the cell on rank(s) {targets}; the pool and its names are kept."
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
        return self.call(
            pool_worker.run_cell,
            source,
            filename,
            first_line,
            env,
            ranks=ranks,
            timeout=timeout,
            renderer=renderer,
        )

    def push(
        self,
        values: dict[str, Any],
        ranks: Iterable[int] | None = None,
        renderer: Renderer | None = None,
    ) -> None:
        """Define ``values`` (name -> object) on ``ranks``; large CPU tensors via shared memory."""
        __tracebackhide__ = True
        try:
            self.call(pool_worker.push_names, values, ranks=ranks, renderer=renderer)
        except UnpicklableError:
            for name, value in values.items():
                try:
                    _, shared = pack(value, name=name)
                except UnpicklableError as exc:
                    raise UnpicklableError(str(exc)) from None
                if shared is not None:
                    shared.release()
            raise

    def pull(
        self, name: str, ranks: Iterable[int] | None = None, renderer: Renderer | None = None
    ) -> dict[int, Any]:
        """The value of ``name`` on each of ``ranks`` (default all)."""
        __tracebackhide__ = True
        return self.call(pool_worker.pull_name, name, ranks=ranks, renderer=renderer)

    def status(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        """One row per rank: pid, device, memory, state (idle/busy/exited), uptime."""
        group = self.group
        rows = []
        details: dict[int, Any] = {}
        if group is not None and group.alive():
            try:
                details = self.call(pool_worker.worker_status, timeout=timeout)
            except Exception:
                details = {}
        for rank in self.ranks:
            pid = self.pids.get(rank)
            row: dict[str, Any] = {"rank": rank, "pid": pid, **self.info.get(rank, {})}
            row.update(details.get(rank, {}))
            row["names"] = len(row["names"]) if isinstance(row.get("names"), list) else "-"
            try:
                process = psutil.Process(pid)
                row["uptime"] = time.time() - process.create_time()
                row.setdefault("rss", process.memory_info().rss)
                running = process.status() != psutil.STATUS_ZOMBIE
            except (psutil.Error, TypeError, ValueError):
                running = False
            busy = group is not None and group.busy(rank)
            row["state"] = "exited" if not running else ("busy" if busy else "idle")
            rows.append(row)
        return rows


def _alive_ranks(group: WorkerGroup) -> list[int]:
    alive = []
    for rank, pid in group.pids.items():
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(rank)
        except psutil.Error:
            pass
    return alive


def _interrupted(outcome: Outcome) -> bool:
    return outcome.kind == "error" and outcome.value.get("name") == "KeyboardInterrupt"


def _first_failure(outcomes: dict[int, Outcome]) -> tuple[int, Outcome] | None:
    """The earliest failure: a peer's error is often a consequence of the first one."""
    failures = [(o.at, r, o) for r, o in outcomes.items() if o.kind != "result"]
    if not failures:
        return None
    _, rank, outcome = min(failures, key=lambda f: (f[0], f[1]))
    return rank, outcome


def _as_exception(rank: int, outcome: Outcome, outcomes: dict[int, Outcome]) -> BaseException:
    if outcome.kind == "crash":
        return RankCrashed(rank, outcome.value, describe_exit(outcome.value))
    exc = rebuild_exception(outcome.value, rank)
    others = sorted(
        r
        for r, o in outcomes.items()
        if r != rank and o.kind == "error" and o.value.get("name") != "KeyboardInterrupt"
    )
    if others and exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]} (rank(s) {others} failed too)", *exc.args[1:])
    return exc


_pool: Pool | None = None


def get_pool() -> Pool | None:
    """The pool started by ``%%distributed`` or :func:`start_pool`, or None."""
    return _pool if _pool is not None and _pool.running else None


def start_pool(
    num_processes: int,
    backend: str | None = None,
    renderer: Renderer | None = None,
    start_method: str = "auto",
) -> Pool:
    """The running pool when it matches ``num_processes``/``backend``, else a new one (the old
    one is shut down)."""
    global _pool
    current = get_pool()
    if current is not None:
        if current.num_processes == num_processes and current.backend == backend:
            return current
        current.shutdown()
    pool = Pool(num_processes, backend=backend, start_method=start_method)
    if renderer is not None:
        renderer.start(f"Starting a pool of {pool.describe()}.", num_processes)
    pool.start(renderer)
    _pool = pool
    return pool


def shutdown_pool() -> bool:
    """Stop the pool; False when none was running."""
    global _pool
    pool, _pool = _pool, None
    if pool is None or not pool.running:
        return False
    pool.shutdown()
    return True
