"""The kernel's agents, kept warm: one per host for the kernel's life, like the local fork server.

The first launch (or pool) that needs a host starts its agent (``ssh host python -m
nbaccel.launch.remote.agent``, or one ``srun`` step on that node); later launches reuse it, so a
relaunch across hosts costs a fork per rank, not an ``import torch`` per host. One
:class:`WarmAgents` per address the hosts reach owns the CURVE hub they all connect to and routes
each agent's messages to the launch (``lid``) they are about.

An agent that died (its ssh or srun process ended, its heartbeat stopped) is counted lost at once:
its process here is ended, every launch using it is told, and the next launch on its host starts
a new agent and says so. At the kernel's exit every agent is told to quit and its process is
reaped; a kernel that dies without a word closes ssh's stdin (ssh) or stops its heartbeat (both),
and each agent kills its ranks and exits by itself.
"""

from __future__ import annotations

import atexit
import contextlib
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from nbaccel.launch.launchers.forkserver.kernel_modules import (
    PreloadSetting,
    kernel_modules,
    preload_setting,
)
from nbaccel.launch.launchers.forkserver.launcher import refused_modules
from nbaccel.launch.remote.hub import Hub
from nbaccel.launch.remote.messages import Kind

__all__ = [
    "AgentHandle",
    "AgentProcess",
    "WarmAgents",
    "kernel_mirror",
    "live_agents",
    "mirror_to_agents",
    "shutdown_agents",
    "warm_agents",
]

#: ``callback(agent id, kind, header)`` for the messages of one launch (and every agent lost)
SessionCallback = Callable[[int, Any, dict[str, Any]], None]


@dataclass
class AgentProcess:
    """The local process (``ssh`` or ``srun``) that runs one host's agent."""

    popen: subprocess.Popen
    what: str  # "ssh nbh1", "srun on node3"
    tail: deque = field(default_factory=lambda: deque(maxlen=20))
    reader: threading.Thread | None = None  # keeps ``tail``; ends with the process's output

    def poll(self) -> int | None:
        """Its exit code, or None while it runs (its watcher thread reaps it)."""
        return self.popen.poll()

    def kill(self) -> None:
        """SIGKILL it now, and wait (briefly) until it is reaped."""
        if self.popen.poll() is None:
            self.popen.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(2.0)

    def why_ended(self, wait: float = 2.0) -> str:
        """What the ended process said last, once its output was read (at most ``wait`` s:
        a child of it may hold the pipe open)."""
        if self.reader is not None:
            self.reader.join(wait)
        code = self.poll()
        said = " | ".join(line for line in self.tail if line.strip())
        return f"{self.what} exited with code {code}" + (f": {said}" if said else "")

    def end(self, grace: float) -> None:
        """Close its stdin (ssh passes the end of input on), then terminate, then kill."""
        with contextlib.suppress(OSError):
            if self.popen.stdin is not None:
                self.popen.stdin.close()
        try:
            self.popen.wait(grace)
            return
        except subprocess.TimeoutExpired:
            self.popen.terminate()
        try:
            self.popen.wait(2.0)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


@dataclass
class AgentHandle:
    """The kernel's view of one host's agent."""

    id: int
    key: Hashable
    name: str
    process: AgentProcess
    hello: dict[str, Any] | None = None  # what the agent said when it came up
    lost: str = ""  # why it is gone (empty while it lives)

    @property
    def pid(self) -> int | None:
        """The agent's process id on its host (once it said hello)."""
        return None if self.hello is None else int(self.hello["pid"])


class WarmAgents:
    """The agents that connect back to ``address``, and the hub they connect to."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a hello, an agent lost or ended
        self._agents: dict[Hashable, AgentHandle] = {}  # the current agent of each key
        self._by_id: dict[int, AgentHandle] = {}
        self._sessions: dict[str, SessionCallback] = {}
        self._closed = False
        #: what the agents were last sent between launches: (scan of sys.modules, agent ids)
        self.mirrored_for: Hashable = None
        self.hub = Hub(address, self._on_event)

    # ------------------------------------------------------------------ launches
    def acquire(
        self,
        key: Hashable,
        name: str,
        start: Callable[[dict[str, Any]], AgentProcess],
        preload: Iterable[str] = (),
    ) -> tuple[AgentHandle, str]:
        """The live agent for ``key``, or a new one from ``start(config)``; the second item is a
        notice for the notebook when the new one replaces an agent that died."""
        with self._lock:
            if self._closed:
                raise RuntimeError("nbaccel's agents were shut down (the kernel is ending)")
            handle = self._agents.get(key)
            if handle is not None and not handle.lost and handle.process.poll() is not None:
                # ended, and its watcher has not said so yet: count it lost now, not mid-launch
                handle.lost = f"its agent ended ({handle.process.why_ended(0.2)})"
                self.hub.lose(handle.id, handle.lost)
            if handle is not None and not handle.lost:
                return handle, ""
            notice = ""
            if handle is not None and handle.hello is not None:  # it served; it never came up:
                notice = f"{handle.lost}; starting a new agent"  # its error said so already
            agent_id, public, secret = self.hub.admit()
            config = {
                "id": agent_id,
                "name": name,
                "hub": f"tcp://{self.address}:{self.hub.port}",
                "server_key": self.hub.server_public,
                "public": public,
                "secret": secret,
                "preload": sorted(set(preload)),
            }
            handle = AgentHandle(agent_id, key, name, start(config))
            self._agents[key] = handle
            self._by_id[agent_id] = handle
        process = handle.process
        process.reader = threading.Thread(
            target=_collect, args=(process,), daemon=True, name="nbaccel-agent-out"
        )
        process.reader.start()
        threading.Thread(
            target=self._watch, args=(handle,), daemon=True, name="nbaccel-agent"
        ).start()
        return handle, notice

    def wait_ready(self, handles: list[AgentHandle], timeout: float) -> None:
        """Wait until every agent of ``handles`` said hello; RuntimeError naming the hosts
        whose agent could not start or did not connect back."""
        with self._changed:
            self._changed.wait_for(
                lambda: (
                    all(h.hello is not None or h.lost for h in handles)
                    or any(h.process.poll() is not None for h in handles)
                ),
                timeout,
            )
        waiting = [h for h in handles if h.hello is None]
        if not waiting:
            return
        for handle in waiting:
            if handle.process.poll() is not None:
                raise RuntimeError(
                    f"could not start nbaccel's agent on {handle.name}: "
                    f"{handle.process.why_ended()}"
                )
            if handle.lost:
                raise RuntimeError(
                    f"could not start nbaccel's agent on {handle.name}: {handle.lost}"
                )
        names = ", ".join(h.name for h in waiting)
        raise RuntimeError(
            f"the agents on {names} did not connect back to {self.address} within "
            f"{timeout:.0f} s: can those hosts reach this address? Pass "
            "channel_address=... to choose another one."
        )

    def open_session(self, lid: str, callback: SessionCallback) -> None:
        """Send launch ``lid``'s messages (and every agent lost) to ``callback``."""
        with self._lock:
            self._sessions[lid] = callback

    def close_session(self, lid: str, agents: Iterable[int]) -> None:
        """Launch ``lid`` is over: its agents end what is left of it, and stay."""
        with self._lock:
            self._sessions.pop(lid, None)
        for agent in agents:
            self.hub.send(agent, Kind.END, {"lid": lid})
        self.hub.route(lid, None)

    def live(self) -> list[AgentHandle]:
        """The agents alive now."""
        with self._lock:
            return [h for h in self._agents.values() if not h.lost]

    def mirror(self, scan: Hashable, modules: Callable[[], list[str]]) -> None:
        """Send ``modules()`` (the kernel's, with its ``sys.path``) to every live agent that
        understands it (an older nbaccel's does not), for its server to import before the next
        launch; nothing when ``scan`` (the kernel's modules) and the agents are what they were
        at the last call."""
        handles = [h for h in self.live() if "mirror" in (h.hello or {}).get("features", ())]
        key = (scan, frozenset(h.id for h in handles))
        if not handles or key == self.mirrored_for:
            return
        self.mirrored_for = key
        header = {"modules": modules(), "sys_path": list(sys.path)}
        for handle in handles:
            self.hub.send(handle.id, Kind.MIRROR, header)

    # ------------------------------------------------------------------ events
    def _on_event(self, agent: int, kind: Any, header: dict[str, Any]) -> None:
        """Called on the hub's thread."""
        handle = self._by_id.get(agent)
        if handle is None:
            return
        if kind == Kind.HELLO:
            with self._changed:
                handle.hello = header
                self._changed.notify_all()
            return
        if kind == Kind.LOST:
            with self._changed:
                handle.lost = handle.lost or header["why"]
                self._changed.notify_all()
            # SIGKILL at once: an agent that is frozen or cut off ends now, not at the kernel's
            # exit (it ends its ranks itself when it hears nothing; ssh's end tells it, too)
            handle.process.kill()
            with self._lock:
                callbacks = list(self._sessions.values())
        else:
            with self._lock:
                callback = self._sessions.get(str(header.get("lid")))
            callbacks = [callback] if callback is not None else []
        for callback in callbacks:
            callback(agent, kind, header)

    def _watch(self, handle: AgentHandle) -> None:
        """An agent process that ends takes its host with it: name it at once (with its last
        words)."""
        handle.process.popen.wait()
        with self._changed:
            self._changed.notify_all()
        if self._closed or handle.lost:
            return
        why = f"its agent ended ({handle.process.why_ended()})"
        handle.lost = handle.lost or why
        self.hub.lose(handle.id, why)

    # ------------------------------------------------------------------ the end
    def close(self, grace: float = 1.0) -> None:
        """Tell every agent to quit (its ranks end with it); reap their processes; stop the hub."""
        with self._lock:
            self._closed = True
            handles = list(self._by_id.values())
        for handle in handles:
            if not handle.lost:
                self.hub.send(handle.id, Kind.QUIT)
        enders = [
            threading.Thread(target=h.process.end, args=(grace,), daemon=True) for h in handles
        ]
        for thread in enders:
            thread.start()
        for thread in enders:
            thread.join(grace + 5.0)
        self.hub.close()


def _collect(process: AgentProcess) -> None:
    """Keep the last lines the agent process printed (ssh's errors, the agent's log)."""
    stream = process.popen.stdout
    if stream is None:
        return
    for raw in iter(stream.readline, b""):
        process.tail.append(raw.decode("utf-8", "replace").rstrip())
    stream.close()


class _Fleets:
    """This kernel's agents, one :class:`WarmAgents` per address they connect back to."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_address: dict[str, WarmAgents] = {}

    def at(self, address: str) -> WarmAgents:
        with self._lock:
            fleet = self._by_address.get(address)
            if fleet is None:
                fleet = self._by_address[address] = WarmAgents(address)
            return fleet

    def all(self, forget: bool = False) -> list[WarmAgents]:
        """Every fleet now (``forget``: and let them go)."""
        with self._lock:
            fleets = list(self._by_address.values())
            if forget:
                self._by_address.clear()
            return fleets


_fleets = _Fleets()


def warm_agents(address: str) -> WarmAgents:
    """This kernel's agents that connect back to ``address`` (made on first use)."""
    return _fleets.at(address)


def kernel_mirror(setting: PreloadSetting) -> list[str]:
    """The modules each host's server imports for the kernel's ranks (quietly: one a host lacks
    is passed over there): what ``setting`` adds, and the kernel's imported modules when it
    mirrors them, less those kept out of this machine's server."""
    exclude = (*setting.exclude, *refused_modules())
    names = [m for m in setting.add if m not in exclude]
    if setting.mirrors():
        names += kernel_modules(exclude)
    return list(dict.fromkeys(names))


def mirror_to_agents(setting: PreloadSetting | None = None) -> None:
    """Have every live agent's server import what the kernel imported since it was last told
    (the kernel's hook after each cell, as for its own fork server): a warm launch after a new
    ``import transformers`` then forks on every host at once. Starts no agent."""
    setting = setting or preload_setting()
    if not setting.mirrors():
        return
    fleets = _fleets.all()
    scan = (len(sys.modules), setting.exclude, len(refused_modules()))
    for fleet in fleets:
        fleet.mirror(scan, lambda: kernel_mirror(setting))


def live_agents() -> list[AgentHandle]:
    """Every agent of this kernel that is alive now, on any host."""
    fleets = _fleets.all()
    return [handle for fleet in fleets for handle in fleet.live()]


def shutdown_agents() -> None:
    """End every agent of this kernel (their ranks with them); the next launch starts new ones.
    Runs at the kernel's exit."""
    fleets = _fleets.all(forget=True)
    for fleet in fleets:
        fleet.close()


atexit.register(shutdown_agents)
