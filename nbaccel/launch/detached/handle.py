"""A detached run seen from any process: submit one, follow it, wait for it, stop or resume it.

:func:`submit` writes the work into a new run folder and asks the supervisor to start it; a
:class:`DetachedRun` is the handle (by id) that any process of the same user can build later.
Results come back as a launch returns them: :meth:`DetachedRun.report` is the engine's call
report, which the fronts turn into per-rank values or the rank's exception.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from nbaccel.launch.detached.client import request as supervisor_request
from nbaccel.launch.detached.folder import ENDED, RunFolder, RunInfo, RunState, list_runs
from nbaccel.launch.detached.replay import Replay
from nbaccel.launch.driver.renderer import Renderer, TextRenderer

__all__ = ["DetachedRun", "RunStopped", "current_runs", "submit"]

_WAIT_POLL = 0.2


class RunStopped(RuntimeError):
    """The result of a run that was stopped (``run.stop()``, its supervisor ending) before
    its ranks returned."""


def submit(
    function: Callable[..., Any],
    args: tuple,
    request: Any,
    *,
    kwargs: dict[str, Any] | None = None,
    setup: Iterable[Callable[[], None]] = (),
    preload: Iterable[str] = (),
    root: Path | None = None,
    num_processes: int | None = None,
) -> RunFolder:
    """Write a run folder for ``function(*args)`` as ``request`` says and have the supervisor
    start it; its folder. Pickling problems are raised here, before anything starts.
    ``num_processes``: the ranks as planned, for the listing (default: the request's)."""
    name = getattr(function, "__name__", None) or type(function).__name__
    folder = RunFolder.create(name, root)
    try:
        folder.write_pickle("work.pkl", {
            "function": function, "args": tuple(args), "kwargs": dict(kwargs or {}),
            "request": request, "setup": tuple(setup), "preload": tuple(preload),
        })  # fmt: skip
    except Exception as exc:  # named as a launch names it: the path inside args, the fix
        import shutil

        from nbaccel.launch.wire.unpicklable import unpicklable_refused

        shutil.rmtree(folder.path, ignore_errors=True)
        work = (function, tuple(args), dict(kwargs or {}))
        names = ("function", "args", "kwargs")
        raise unpicklable_refused(exc, work, "work", names, "ranks") from exc
    folder.write_json("launch.json", {
        "python": sys.executable, "env": _environment(request), "cwd": os.getcwd(),
        "sys_path": [p for p in sys.path if p],
    })  # fmt: skip
    hosts = request.hosts if isinstance(request.hosts, str) else ",".join(request.hosts or [])
    folder.update(num_processes=num_processes or request.num_processes,
                  hosts=hosts or (request.launcher or "localhost"))  # fmt: skip
    try:
        supervisor_request("start", folder.path.parent, run=folder.id)
    except BaseException as exc:  # nothing started: the folder says why, the caller sees it
        folder.update(state=RunState.FAILED, ended=time.time(),
                      reason=f"not started: {type(exc).__name__}: {exc}"[:300])  # fmt: skip
        raise
    return folder


def _environment(request: Any) -> dict[str, str]:
    """The run's environment: this process's, plus the Ray cluster this process's ``ray.init``
    connected to when the launch goes to Ray without naming one (the runner is another
    process: it could not find the cluster otherwise)."""
    env = dict(os.environ)
    ray = sys.modules.get("ray")
    wants_ray = request.launcher == "ray" and not request.ray_address
    if wants_ray and "RAY_ADDRESS" not in env and ray is not None and ray.is_initialized():
        from nbaccel.launch.remote.ray.connect import cluster_address

        env["RAY_ADDRESS"] = cluster_address(ray)
    return env


class DetachedRun:
    """A handle on one detached run, by id (see the module docstring)."""

    def __init__(self, run_id: str, root: Path | None = None) -> None:
        self.folder = RunFolder.find(run_id, root)
        self.id = self.folder.id

    @property
    def info(self) -> RunInfo:
        """The run's current ``run.json``."""
        return self.folder.info()

    @property
    def state(self) -> str:
        """``starting``, ``running``, ``finished``, ``failed`` or ``stopped``."""
        info = self.info
        return self.info.state if self._lost(info) else info.state

    def done(self) -> bool:
        """True once the run has ended."""
        return self.state in ENDED

    def follow(
        self, renderer: Renderer | None = None, follow: bool = True, stop: Any = None
    ) -> None:
        """Replay the run's output into ``renderer`` (default text); with ``follow``, live
        until the run ends (or ``stop``, a ``threading.Event``, is set)."""
        Replay(self.folder, renderer or TextRenderer()).run(follow=follow, stop=stop)

    def wait(self, timeout: float | None = None) -> RunInfo:
        """Wait until the run ends (TimeoutError after ``timeout`` seconds); its info."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            info = self.info
            if info.state in ENDED:
                return info
            if self._lost(info):
                continue
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run {self.id} is still {info.state} after {timeout} s.")
            time.sleep(_WAIT_POLL)

    def _lost(self, info: RunInfo) -> bool:
        """A run whose runner process is gone without saying how it ended (it and its
        supervisor were killed together): mark it failed; whether it was."""
        from nbaccel.launch.host.processes import pid_alive

        if info.state != RunState.RUNNING or info.runner_pid is None:
            return False
        if pid_alive(info.runner_pid):
            return False
        time.sleep(_WAIT_POLL)  # it may have written its end just now
        info = self.info
        if info.state != RunState.RUNNING or info.runner_pid is None:
            return False
        self.folder.update(state=RunState.FAILED, ended=time.time(), runner_pid=None,
                           reason="its runner process vanished (killed along with its "
                           "supervisor?): resume it")  # fmt: skip
        return True

    def report(self, timeout: float | None = None) -> Any:
        """Wait for the end; the last attempt's call report (``CallReport``). A run stopped
        before its ranks returned raises :class:`RunStopped`; a launch that could not run
        raises its error."""
        info = self.wait(timeout)
        try:
            outcome = self.folder.read_pickle("result.pkl")
        except FileNotFoundError:
            raise RunStopped(
                f"run {self.id} ended ({info.state}: {info.reason or 'no reason recorded'}) "
                "without a result."
            ) from None
        if "stopped" in outcome:
            raise RunStopped(f"run {self.id} was stopped ({outcome['stopped']}) before its "
                             f"ranks returned; resume it with run.resume().")  # fmt: skip
        if "error" in outcome:
            raise outcome["error"]
        return outcome["report"]

    def stop(self, wait: bool = True, timeout: float | None = 60.0) -> RunInfo:
        """Stop the run as the stop button stops a launch (every rank, no orphans, shared
        memory freed); with ``wait``, until it has ended."""
        if not self.done():
            supervisor_request("stop", self.folder.path.parent, run=self.id)
        return self.wait(timeout) if wait else self.info

    def resume(self) -> None:
        """Launch the same function and arguments again on fresh ranks, in the same folder
        (an Accelerator with automatic checkpoint naming loads the newest checkpoint)."""
        info = self.info
        if info.state not in ENDED:
            raise ValueError(f"run {self.id} is {info.state}: stop it before resuming it.")
        self.folder.update(state=RunState.STARTING)
        try:
            supervisor_request("resume", self.folder.path.parent, run=self.id)
        except BaseException:
            self.folder.update(state=info.state)
            raise

    def remove(self) -> None:
        """Remove the ended run's folder (its output, result and work): ``nbaccel runs rm``."""
        from nbaccel.launch.detached.folder import remove_runs

        remove_runs([self.id], root=self.folder.path.parent)

    def __repr__(self) -> str:
        info = self.info
        return f"<Run {info.id} {info.name!r}: {info.state}, {info.num_processes} ranks>"


def current_runs(root: Path | None = None) -> list[RunInfo]:
    """Every run under ``root`` (default: this user's), oldest first, a run whose process
    vanished without saying how it ended marked failed first."""
    found = list_runs(root)
    for index, info in enumerate(found):
        run = DetachedRun(info.id, root)
        if run._lost(info):
            found[index] = run.info
    return found
