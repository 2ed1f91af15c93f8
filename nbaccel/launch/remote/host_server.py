"""A host's fork server, generation after generation: what the ranks of that host start with.

The agent's first server is forked from the agent itself (torch imported once per host). Each
launch that begins on the host has it import the kernel's modules (:meth:`HostServer.begin`).
Two things give the host a new server, a fresh interpreter (the agent has threads and sockets by
then, so it cannot fork another):

- an import that made the server unsafe to fork (it initialised CUDA, started a thread, opened a
  socket): that module is kept out of every later server of the host, and each of the host's
  ranks imports it itself;
- a file of a module the server imported that changed since (a user module edited between two
  launches): the next launch's ranks get the file as it is now. The server notes the files it
  imported itself (the kernel's copy may be another path, or on another machine), and the
  agent compares them when a launch begins.

Either way the host says so once, one line per module, to the launch during which it replaced
its server (:meth:`HostServer.take_notices`; the kernel shows them as ``node2: ...``): once per
server generation, not on every launch. A server replaced while ranks of it still run (a
pool's) is closed once they end.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable

from nbaccel.launch.launchers.forkserver.launcher import (
    ENGINE_PRELOAD,
    CudaInitializedInServer,
    ForkServer,
)

__all__ = ["HostServer"]

#: how often one rank's start replaces an unsafe server before it gives up
_MAX_GENERATIONS = 8
#: seconds a new server may take to import torch
_START_TIMEOUT = 120.0

#: ``keep_alive(timeout)``: wait at most ``timeout`` s (less when the server reports something)
#: while keeping the kernel's link alive (the agent pings it)
KeepAlive = Callable[[float], None]


def _parents_first(names: Iterable[str]) -> list[str]:
    return sorted(names, key=lambda n: (n.count("."), n))


class HostServer:
    """The agent's current fork server, the servers it replaced, the modules kept out."""

    def __init__(self, preload: Iterable[str], wake: Callable[[], None]) -> None:
        self._wake = wake
        # forked from the agent, which imported torch already, before it has threads or sockets
        self.server = ForkServer(preload, fork=True, own_stamps=True)
        self.server.add_wakeup(wake)
        #: servers replaced while their ranks (a pool's) still ran: closed once those end
        self.retired: list[ForkServer] = []
        #: modules whose import made a server of this host unsafe to fork, and why
        self.kept_out: dict[str, str] = {}
        self.generation = 1
        self.path: list[str] = list(sys.path)  # where the kernel's modules are looked for
        self._notices: list[str] = []

    def wait_ready(self) -> None:
        self.server.wait_ready()

    def is_kept_out(self, module: str) -> bool:
        """``module`` (or a package above it) made a server of this host unsafe to fork."""
        return any(module == m or module.startswith(m + ".") for m in self.kept_out)

    def take_notices(self) -> list[str]:
        """The lines for the notebook since the last call (a server replaced, and why)."""
        notices, self._notices = self._notices, []
        return notices

    # ------------------------------------------------------------------ launches
    def begin(
        self, preload: Iterable[str], mirror: Iterable[str], kernel_path: Iterable[str] = ()
    ) -> None:
        """A launch begins on this host: a server made unsafe, or whose files changed, is
        replaced first; then it imports ``preload`` and the kernel's modules ``mirror``, looked
        for on this host's ``sys.path``, then on the kernel's other entries (``kernel_path``:
        where they exist here, a shared filesystem, they find the notebook's own modules, as
        the ranks do)."""
        self.mirror(mirror, kernel_path)
        self.server.preload(m for m in preload if not self.is_kept_out(m))

    def mirror(self, modules: Iterable[str], kernel_path: Iterable[str] = ()) -> None:
        """Have the server import the kernel's ``modules`` (see :meth:`begin`), a server made
        unsafe or stale replaced first. Also between launches (the kernel sends what it
        imported after a cell): the next launch then forks at once, and hears of a replaced
        server then."""
        self._close_idle_retired()
        self.path = list(sys.path) + [p for p in kernel_path if p not in sys.path]
        if not self._renew_unsafe():
            stale = self.server.stale()
            if stale:
                them = "them" if len(stale) > 1 else "it"
                self._notices.append(
                    f"{', '.join(sorted(stale))} changed since the fork server there imported "
                    f"{them}: a fresh server imports the files as they are now."
                )
                self._replace()
        self.server.mirror(
            [m for m in modules if not self.is_kept_out(m)], stamp=False, path=self.path
        )

    def spawn(self, spec_bytes: bytes, keep_alive: KeepAlive) -> int:
        """Fork one rank; its pid. A server that an import made unsafe gives way to a new one
        without that module (RuntimeError when torch itself was the culprit). Waits (the
        server may be importing) through ``keep_alive``."""
        for _ in range(_MAX_GENERATIONS):
            self._wait_started(keep_alive)
            try:
                return self.server.spawn_many([spec_bytes], keep_alive)[0]
            except CudaInitializedInServer:
                if not self._renew_unsafe():
                    raise
        raise RuntimeError(
            f"the fork server on this host was made unsafe {_MAX_GENERATIONS} times by the "
            "kernel's modules; pass preload=False (or set NBACCEL_PRELOAD=off) to launch "
            "without them."
        )

    def _wait_started(self, keep_alive: KeepAlive) -> None:
        """Until the server imported torch (a new generation takes seconds)."""
        deadline = time.monotonic() + _START_TIMEOUT
        server = self.server
        while not server.ready() and server.alive() and time.monotonic() < deadline:
            keep_alive(0.1)

    # ------------------------------------------------------------------ generations
    def _renew_unsafe(self) -> bool:
        """Replace a server that an import made unsafe to fork by one without those modules,
        each named once; False when it is safe, or when torch itself was the culprit (nothing
        to leave out: its refusal says why)."""
        old = self.server
        if not old.unsafe or set(old.unsafe) & set(ENGINE_PRELOAD):
            return False
        for module, why in old.unsafe.items():
            self.kept_out[module] = why
            top = module.partition(".")[0]
            self._notices.append(
                f"{module} is not preloaded for the ranks there: {why}; each rank imports it "
                f"itself. To silence this, set NBACCEL_PRELOAD=-{top} (or pass "
                f"preload='-{top}')."
            )
        self._replace()
        return True

    def _replace(self) -> None:
        """A new server (a fresh interpreter) importing what the old one was asked to, less
        the modules kept out; the old one retired."""
        old = self.server
        front = old.preloaded - set(ENGINE_PRELOAD)
        self.server = ForkServer(
            _parents_first(m for m in front if not self.is_kept_out(m)), own_stamps=True
        )
        self.server.add_wakeup(self._wake)
        self.server.mirror(
            _parents_first(m for m in old.mirrored if not self.is_kept_out(m)),
            stamp=False,
            path=self.path,
        )
        self.generation += 1
        if old.running_ranks() and old.alive():
            self.retired.append(old)
        else:
            old.close()

    def _close_idle_retired(self) -> None:
        for server in list(self.retired):
            if not server.running_ranks() or not server.alive():
                self.retired.remove(server)
                server.close()

    def close(self) -> None:
        for server in (*self.retired, self.server):
            server.close()
        self.retired.clear()
