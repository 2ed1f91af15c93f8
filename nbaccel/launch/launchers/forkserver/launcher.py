"""A fork server with torch preloaded: launches cost a fork, not an ``import torch``.

The server is a plain child process of the notebook kernel (``python -c ...``) that imports torch
and nbaccel's worker module once, then forks a fresh worker per request. The front that launches
adds its own modules to preload (the notebook's worker hooks, say): the server imports them once,
before the next fork. Because the server never
touches CUDA, forking it is safe even when the kernel has already initialised CUDA (the reason
fork-based launchers refuse to start after a notebook touched the GPU).

The server process (its loop, its protocol) is :mod:`nbaccel.launch.launchers.forkserver.loop`;
the driver's handle on one server is :mod:`nbaccel.launch.launchers.forkserver.handle`. This module
is the process's server: started when needed, told what the kernel imports (``kernel_modules``),
replaced by a new one when an import made it unsafe or a module's file changed; and the
launcher that forks ranks from it.
"""

from __future__ import annotations

import atexit
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from nbaccel.launch.host.processes import WorkerProcess
from nbaccel.launch.launchers.base import ProcessLauncher
from nbaccel.launch.launchers.fork import ForkLauncher
from nbaccel.launch.launchers.forkserver.handle import (
    ForkedServerProcess,
    ForkServer,
    ProcessStartError,
)
from nbaccel.launch.launchers.forkserver.kernel_modules import (
    PreloadSetting,
    in_kernel,
    is_candidate,
    kernel_modules,
    preload_setting,
)
from nbaccel.launch.launchers.forkserver.loop import (
    ENGINE_PRELOAD,
    CudaInitializedInServer,
)
from nbaccel.launch.wire.protocol import LaunchKind
from nbaccel.launch.wire.spec import WorkerSpec
from nbaccel.launch.wire.transport import sweep_segments
from nbaccel.values.booleans import env_flag

__all__ = [
    "ENGINE_PRELOAD",
    "CudaInitializedInServer",
    "ForkServer",
    "ForkedServerProcess",
    "ProcessStartError",
    "ForkServerLauncher",
    "get_forkserver",
    "mirror_kernel_modules",
    "preload_report",
    "refused_modules",
    "shutdown_forkserver",
    "wait_preloaded",
    "warm_up",
    "warm_up_if_in_kernel",
]


class _ProcessWide:
    """The process's one fork server, and the lock that guards (re)starting it."""

    def __init__(self) -> None:
        self.server: ForkServer | None = None
        self.lock = threading.Lock()
        #: servers replaced while their ranks (a pool's) still run: closed once those end
        self.retired: list[ForkServer] = []
        #: modules kept out of every server of this process, and why
        self.refused: dict[str, str] = {}
        #: lines for the next launch's output (what was kept out, and why)
        self.notices: list[str] = []


_process_wide = _ProcessWide()

#: how often one launch starts a new server after an import made one unsafe
_MAX_GENERATIONS = 8


def _retire(server: ForkServer) -> None:
    """Put ``server`` aside: closed now when no rank of it runs, else once they end."""
    if server.running_ranks():
        _process_wide.retired.append(server)
    else:
        server.close()


def _close_idle_retired() -> None:
    for server in list(_process_wide.retired):
        if not server.running_ranks() or not server.alive():
            _process_wide.retired.remove(server)
            server.close()


def _why_replace(server: ForkServer) -> bool:
    """True when ``server`` must give way to a new one: an import made it unsafe to fork (the
    module is then kept out, and named), or a mirrored module's file changed."""
    if server.unsafe:
        if set(server.unsafe) & set(ENGINE_PRELOAD):
            return False  # torch itself: nothing to leave out (spawn_many says so)
        for module, why in server.unsafe.items():
            _process_wide.refused[module] = why
            top = module.partition(".")[0]
            _process_wide.notices.append(
                f"{module} is not preloaded for the ranks: {why}; each rank imports it itself. "
                f"To silence this, set NBACCEL_PRELOAD=-{top} (or pass preload='-{top}')."
            )
        return True
    stale = server.stale()
    if stale:
        _process_wide.notices.append(
            f"{', '.join(sorted(stale))} changed since the fork server imported "
            f"{'them' if len(stale) > 1 else 'it'}: a fresh server imports the files as they "
            "are now."
        )
        return True
    return False


def get_forkserver(
    preload: Iterable[str] = (), setting: PreloadSetting | None = None
) -> ForkServer:
    """The process-wide fork server, (re)started when needed, with ``preload`` imported, and,
    when ``setting`` says so, the modules this process imported (see ``kernel_modules``)."""
    with _process_wide.lock:
        _close_idle_retired()
        refused = _process_wide.refused
        server = _process_wide.server
        front = set(preload)
        if server is not None and server.alive() and _why_replace(server):
            front |= server.front
            _retire(server)
            server = _process_wide.server = None
        front = {m for m in front if m not in refused}
        if server is None or not server.alive():
            if server is not None:
                server.close()  # reap the dead one, close its pipes
            sweep_segments()  # a new kernel: reclaim the shared memory of dead ones
            server = _process_wide.server = ForkServer(sorted(front))
        else:
            server.preload(front)
        if setting is not None:
            server.mirror([m for m in setting.add if m not in refused], quiet=False)
            # a scan of sys.modules takes tens of ms with transformers imported: only when it
            # grew since this server was last told (a no-op launch costs a fork, not a scan)
            if setting.mirrors() and server.scanned != (len(sys.modules), setting.exclude):
                server.mirror(kernel_modules((*setting.exclude, *refused)))
                server.scanned = (len(sys.modules), setting.exclude)
        return server


def mirror_kernel_modules(setting: PreloadSetting | None = None) -> None:
    """Have the running fork server import what this process has imported since (the kernel's
    hook after each cell, so that the work happens while the user types); a server made unsafe
    or stale is replaced now. Starts no server where none runs."""
    setting = setting or preload_setting()
    server = _process_wide.server
    if server is None or not server.alive() or not setting.mirrors():
        return
    # after every cell, a warm %%distributed one too: scan sys.modules only when it grew
    # (get_forkserver), look at the user files' dates always (a few)
    if server.scanned != (len(sys.modules), setting.exclude) or server.unsafe or server.stale():
        get_forkserver((), setting)


def mirror_soon(name: str) -> None:
    """Have the running server import module ``name``, which this process starts importing
    now (the kernel's import hook): both imports then run at once. Never waits: a server
    being (re)started, or a launch under way, lets the next cell's hook do it."""
    if not _process_wide.lock.acquire(blocking=False):
        return
    try:
        server = _process_wide.server
        if server is None or not server.alive() or server.unsafe:
            return
        exclude = (*preload_setting().exclude, *_process_wide.refused)
        if is_candidate(name, exclude):
            server.mirror([name], stamp=False)
    finally:
        _process_wide.lock.release()


def wait_preloaded(timeout: float = 300.0) -> bool:
    """Wait until the fork server has imported what it was sent (a server made unsafe, or
    whose modules' files changed, replaced first); False when ``timeout`` seconds were not
    enough. The next launch then forks its ranks from it with nothing left to wait for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        server = _process_wide.server
        if server is None or not server.alive():
            return True
        if server.unsafe or server.stale():
            get_forkserver((), preload_setting())  # its successor
            continue
        server.release()
        if not server.importing():
            return True
        time.sleep(0.05)
    return False


def refused_modules() -> dict[str, str]:
    """The modules kept out of this process's fork servers (their imports made forking
    unsafe), and why."""
    return dict(_process_wide.refused)


def preload_report() -> dict[str, Any]:
    """What ranks forked now start with: the server's pid and resident memory, the top-level
    modules it imported for the kernel, the seconds that took, and the modules kept out."""
    server = _process_wide.server
    report: dict[str, Any] = {
        "setting": preload_setting().describe(),
        "refused": dict(_process_wide.refused),
    }
    if server is not None and server.alive():
        report.update(
            server_pid=server.pid,
            server_rss=server.rss(),
            preloaded=list(server.imported),
            import_seconds=round(server.import_seconds, 2),
        )
    return report


def warm_up(preload: Iterable[str] = (), setting: PreloadSetting | None = None) -> None:
    """Start the fork server now, so its ``import torch`` (and the libraries the kernel
    imported already, by ``setting``) overlaps with the user's typing."""
    get_forkserver(preload, setting)


def warm_up_if_in_kernel(preload: Iterable[str] = ()) -> None:
    """Warm the fork server when nbaccel is imported in a Jupyter kernel (not in workers)."""
    if env_flag("NBACCEL_NO_WARMUP") or not hasattr(os, "fork"):
        return
    if in_kernel():
        warm_up(preload, preload_setting())


class ForkServerLauncher(ProcessLauncher):
    """Fork each rank from the process-wide server (torch and ``preload`` already imported,
    and the launching kernel's libraries as ``setting`` says: see ``kernel_modules``)."""

    name = LaunchKind.FORKSERVER

    def __init__(
        self,
        preload: Iterable[str] = (),
        setting: PreloadSetting | None = None,
        fork_while_importing: bool = False,
    ) -> None:
        super().__init__(preload)
        self.setting = setting or preload_setting()
        #: a one-shot launch may fork its ranks from the kernel itself while the server still
        #: imports the kernel's libraries, when the kernel has not used CUDA (see prepare)
        self.fork_while_importing = fork_while_importing
        self._server: ForkServer | None = None
        self._forked: ForkLauncher | None = None

    def prepare(self) -> None:
        self._server = get_forkserver(self.preload, self.setting)
        # Waiting for the server would cost as long as the kernel's own imports took (seconds,
        # when the notebook imported nbaccel after transformers); a fork of the kernel has them
        # now. Only where that is safe: no CUDA in the kernel, and a launch whose ranks end
        # with it (not a pool's).
        if (
            self.fork_while_importing
            and self.setting.mirrors()
            and self._server.importing()
            and not _cuda_initialized_here()
        ):
            self._forked = ForkLauncher()
            self._server.hold()  # its imports wait while these ranks start on the same cores
            _process_wide.notices.append(
                "the fork server is still importing the notebook's libraries: this launch's "
                "ranks are forked from the notebook itself (it has not used CUDA); later "
                "launches fork from the server."
            )

    def close(self) -> None:
        if self._forked is not None and self._server is not None:
            self._server.release()

    def _current(self) -> ForkServer:
        if self._server is None or not self._server.alive():
            self._server = get_forkserver(self.preload, self.setting)
        return self._server

    def start(self, spec: WorkerSpec) -> WorkerProcess:
        return self.start_many([spec])[0]

    def start_many(
        self, specs: Sequence[WorkerSpec], while_waiting: Callable[[float], object] | None = None
    ) -> list[WorkerProcess]:
        if self._forked is not None:
            return self._forked.start_many(specs, while_waiting)
        data = [pickle.dumps(spec) for spec in specs]
        for _ in range(_MAX_GENERATIONS):
            server = self._current()
            try:
                pids = server.spawn_many(data, while_waiting)
            except CudaInitializedInServer:
                if not server.unsafe or set(server.unsafe) & set(ENGINE_PRELOAD):
                    shutdown_forkserver()  # unusable for GPUs: the next launch starts afresh
                    self._server = None
                    raise
                # an import made it unsafe: a new server without that module (named once)
                self._server = get_forkserver(self.preload, self.setting)
                continue
            self._summarise(server)
            return [WorkerProcess(pid, self.name, server=server) for pid in pids]
        raise RuntimeError(
            f"nbaccel's fork server was made unsafe {_MAX_GENERATIONS} times by the kernel's "
            "modules; pass preload=False (or set NBACCEL_PRELOAD=off) to launch without them."
        )

    def _summarise(self, server: ForkServer) -> None:
        """The launch summary's line on what ranks start with, once per server."""
        if server.announced or not server.imported:
            return
        server.announced = True
        names = server.imported
        shown = ", ".join(names[:6]) + (f" (+{len(names) - 6} more)" if len(names) > 6 else "")
        rss = server.rss()
        memory = f", server {rss / 2**30:.1f} GiB resident" if rss else ""
        _process_wide.notices.append(
            f"ranks start with {shown} imported (preloaded from the notebook's imports"
            f"{memory}; preload=False or NBACCEL_PRELOAD=off turns it off)."
        )

    def take_notices(self) -> list[str]:
        notices, _process_wide.notices[:] = list(_process_wide.notices), []
        return notices

    def add_wakeup(self, callback: Callable[[], None]) -> None:
        self._current().add_wakeup(callback)

    def remove_wakeup(self, callback: Callable[[], None]) -> None:
        if self._server is not None:
            self._server.remove_wakeup(callback)


def _cuda_initialized_here() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def shutdown_forkserver() -> None:
    """Stop and reap the process-wide fork server (at exit, or when asked)."""
    with _process_wide.lock:
        server, _process_wide.server = _process_wide.server, None
        retired, _process_wide.retired[:] = list(_process_wide.retired), []
    for old in [*retired, server]:
        if old is not None:
            old.close()


atexit.register(shutdown_forkserver)
