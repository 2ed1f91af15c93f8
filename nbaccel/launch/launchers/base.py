"""The launcher interface: start these ranks somewhere, hand back process handles.

Every way of starting ranks (fork server, spawn, fork, XLA; the remote variants ssh and slurm
in ``nbaccel.launch.remote``) is a :class:`ProcessLauncher`. The worker group gives it one
:class:`~nbaccel.launch.wire.spec.WorkerSpec` per rank; the spec names the channel (the address of
the driver's authenticated listener) the rank connects back to. A variant whose ranks reach this
machine directly names the address to listen on through :attr:`ProcessLauncher.channel_host`;
the ssh and slurm variants keep the private socket and tunnel their ranks' connections to it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

from nbaccel.launch.host.processes import WorkerProcess
from nbaccel.launch.wire.spec import WorkerSpec

__all__ = ["ProcessLauncher"]


class ProcessLauncher(ABC):
    """One way of starting rank processes."""

    name: ClassVar[str]  # its LaunchKind (a str enum); tests register their own kinds
    #: True when the work travels pickled; False when children inherit it (``fork``-based).
    pickles_work: ClassVar[bool] = True
    #: True when the ranks are forked from the driver itself after the work is packed, so they
    #: inherit what the pickle leaves behind (a multiprocessing.Queue in the arguments).
    forks_driver: ClassVar[bool] = False
    #: The host the driver's listener binds for this launcher's ranks: None is a private Unix
    #: socket (ranks on this machine); a remote launcher names an address its hosts can reach.
    channel_host: str | None = None
    #: True when the ranks run on this machine and can map its shared memory (/dev/shm)
    local_memory: ClassVar[bool] = True

    def __init__(self, preload: Iterable[str] = ()) -> None:
        #: modules worth importing once before the ranks start (used by the fork server)
        self.preload = tuple(preload)

    def add_preload(self, modules: Iterable[str]) -> None:
        """Also preload ``modules`` (what this launch's ranks will import as they start)."""
        self.preload = tuple(dict.fromkeys((*self.preload, *modules)))

    @property
    def hosts_by_rank(self) -> Mapping[int, str]:
        """The host of each rank (global rank -> host name) when ranks run on other hosts;
        their worker group's output and errors then name it: ``[rank 5 @ node2]``."""
        return {}

    def describe(self) -> str:
        """What the launch announcement adds about where the ranks run (empty: this machine)."""
        return ""

    def prepare(self) -> None:  # noqa: B027 - optional hook
        """Called once before the first rank starts (start a server, check the runtime...)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Called when the worker group is torn down (stop remote agents, free sockets...)."""

    @abstractmethod
    def start(self, spec: WorkerSpec) -> WorkerProcess:
        """Start the rank described by ``spec``; return its handle at once (do not wait)."""

    def start_many(
        self, specs: Sequence[WorkerSpec], while_waiting: Callable[[float], object] | None = None
    ) -> list[WorkerProcess]:
        """Start several ranks; a variant that can ask for them all at once overrides this.
        ``while_waiting(0)`` runs between starts (the driver authenticates the ranks already up
        meanwhile, instead of leaving them waiting until the last one started)."""
        started = []
        for spec in specs:
            if started and while_waiting is not None:
                while_waiting(0.0)
            started.append(self.start(spec))
        return started

    def place_work(self, work: Any, ranks: Iterable[int]) -> dict[int, Any]:
        """The work each of ``ranks`` receives for a call; ranks on other hosts get its shared
        tensors in their host's memory (sent there once per host)."""
        return {rank: work for rank in ranks}

    def release_work(self) -> None:  # noqa: B027 - optional hook
        """Every rank has mapped the shared tensors placed so far: their files may go."""

    def take_notices(self) -> list[str]:
        """Messages for the notebook that arrived since the last call (a remote host's agent
        saying its ranks run elsewhere than asked, ...)."""
        return []

    def add_wakeup(self, callback: Callable[[], None]) -> None:  # noqa: B027 - optional hook
        """Call ``callback()`` from any thread when a started process may have ended."""

    def remove_wakeup(self, callback: Callable[[], None]) -> None:  # noqa: B027
        """Undo :meth:`add_wakeup`."""
