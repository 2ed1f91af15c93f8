"""Ranks on other hosts: the launcher variant shared by ``ssh`` and ``slurm``.

``prepare`` takes this kernel's warm agent of every host (``warm.py``: started by the first
launch that needs it, ``ssh.py``/``slurm.py`` say how, reused by every later one), begins a
launch on each (``BEGIN``: its folder, its modules; each answers ``READY`` with a free port and
its channel's entrance) and routes the launch's tunnelled connections to the worker group's
listener. ``start`` then turns the worker group's spec into the host's (its paths, its
environment plus the launch's variables, the address of the agent's tunnel, the shared tensors in
its /dev/shm), which the agent hands unchanged to its fork server. Host 0's agent chose
``MASTER_PORT``; its address is ``MASTER_ADDR``. ``close`` ends the launch on every agent; the
agents stay for the next one.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import secrets
import socket
import sys
import threading
from abc import abstractmethod
from collections.abc import Callable, Hashable, Iterable
from typing import Any

from nbaccel.launch.launchers.base import ProcessLauncher
from nbaccel.launch.launchers.forkserver.kernel_modules import (
    PreloadSetting,
    preload_setting,
)
from nbaccel.launch.options.accelerate_env import is_contract_variable
from nbaccel.launch.remote.hosts import Host
from nbaccel.launch.remote.messages import Kind
from nbaccel.launch.remote.options import RemoteOptions
from nbaccel.launch.remote.process import RemoteProcess
from nbaccel.launch.remote.reachable import check_local_address
from nbaccel.launch.remote.warm import (
    AgentHandle,
    AgentProcess,
    WarmAgents,
    kernel_mirror,
    warm_agents,
)
from nbaccel.launch.wire.channel import Address
from nbaccel.launch.wire.spec import WorkerSpec
from nbaccel.launch.wire.transport import Packed

__all__ = ["AgentProcess", "RemoteLauncher"]

_START_TIMEOUT = 120.0
AGENT_MODULE = "nbaccel.launch.remote.agent"


def _route_address(target: str) -> str:
    """This machine's address on the route to ``target`` (an address or a name)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((target, 9))  # sends nothing: only picks the route
        return probe.getsockname()[0]


class RemoteLauncher(ProcessLauncher):
    """Start ranks through one warm agent per host; subclasses say how agents start."""

    pickles_work = True
    local_memory = False

    def __init__(
        self,
        preload: Iterable[str] = (),
        remote: RemoteOptions | None = None,
        setting: PreloadSetting | None = None,
    ) -> None:
        super().__init__(preload)
        #: what each host's fork server imports for the ranks beyond ``preload``: the modules
        #: the kernel imported (less those its own server kept out), as ``setting`` says
        self.setting = setting or preload_setting()
        if remote is None:
            raise ValueError(f"the {self.name} launcher needs the hosts (RemoteOptions).")
        self.options = remote
        self.layout = remote.layout
        if remote.channel_address:
            check_local_address(remote.channel_address, "channel_address")
        self.channel_address = remote.channel_address or self.find_channel_address()
        self.fleet: WarmAgents | None = None
        self.lid = secrets.token_hex(6)
        self.agents: list[AgentHandle] = []  # by node
        self._node_of: dict[int, int] = {}  # agent id -> node
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # an agent ready, or lost
        self._ready: dict[int, dict[str, Any]] = {}
        self._lost: dict[int, str] = {}
        self._processes: dict[int, RemoteProcess] = {}
        self._work_names: dict[int, str] = {}
        self._work_sent: set[tuple[int, str]] = set()
        self._wakeups: list[Callable[[], None]] = []
        self._notices: list[str] = []

    # ------------------------------------------------------------------ subclasses
    @abstractmethod
    def find_channel_address(self) -> str:
        """The address of this machine that the hosts reach (raise ValueError if unknown)."""

    @abstractmethod
    def agent_key(self, host: Host) -> Hashable:
        """What makes an agent of ``host`` fit this launch (host, interpreter, transport
        arguments): launches with equal keys share the agent."""

    @abstractmethod
    def start_agent(self, host: Host, config: dict[str, Any]) -> AgentProcess:
        """Start ``host``'s agent with ``config`` (kept off argv: its secret key is in it)."""

    def rank_threads(self, node: int, cpus: int) -> int:
        """torch threads of each rank on ``node`` (its host has ``cpus`` cores): a fair share
        of the machine. Hosts that are one machine (containers or namespaces of one kernel:
        their agents saw the same boot id) share its cores among all their ranks."""
        machine = (self.agents[node].hello or {}).get("machine")
        ranks = sum(
            host.slots
            for other, host in enumerate(self.layout.hosts)
            if other == node
            or (machine and (self.agents[other].hello or {}).get("machine") == machine)
        )
        return max(1, cpus // ranks)

    def node_env(self, node: int) -> dict[str, str]:
        """Variables every rank of ``node`` gets from the launcher (Ray: its GPUs)."""
        return {}

    @classmethod
    def placed(cls, remote: RemoteOptions, pool: bool) -> RemoteOptions:
        """``remote`` with its layout known; called when the plan is made, before anything
        starts. The hosts of ssh and SLURM are known already; a variant whose scheduler
        places the ranks (Ray) asks it here."""
        return remote

    # ------------------------------------------------------------------ the interface
    @property
    def hosts_by_rank(self) -> dict[int, str]:
        return {r: self.layout.host_of(r).name for r in range(self.layout.num_processes)}

    def describe(self) -> str:
        return (
            f" on {_hosts(len(self.layout.hosts))} ({self.layout.describe()}) over "
            f"{self.options.kind}; their agents connect back to {self.channel_address} "
            "(ZeroMQ CURVE: encrypted, only this kernel's agent keys admitted)"
        )

    def prepare(self) -> None:
        if self.fleet is not None:
            return
        self.lid, self.agents = secrets.token_hex(6), []
        self._ready.clear()
        self._lost.clear()
        self.fleet = warm_agents(self.channel_address)
        self.fleet.open_session(self.lid, self._on_event)
        try:
            self._take_agents(range(len(self.layout.hosts)))
            lost = self._wait_for_launch(retry=True)
            if lost:  # warm agents that died before this kernel noticed: new ones, once
                self._take_agents(lost)
                self._wait_for_launch(retry=False)
        except BaseException:
            self.close()
            raise

    def _take_agents(self, nodes: Iterable[int]) -> None:
        """Take (or start) the agents of ``nodes``, wait for them, begin the launch on each."""
        assert self.fleet is not None
        nodes = list(nodes)
        for node in nodes:
            host = self.layout.hosts[node]
            handle, notice = self.fleet.acquire(
                self.agent_key(host),
                host.name,
                lambda config, host=host: self.start_agent(host, config),
                self.preload,
            )
            if notice:
                self._notices.append(f"{host.name}: {notice}")
            if node < len(self.agents):
                self.agents[node] = handle
            else:
                self.agents.append(handle)
        with self._lock:
            for node in nodes:
                self._ready.pop(node, None)
                self._lost.pop(node, None)
            self._node_of = {h.id: node for node, h in enumerate(self.agents)}
        self.fleet.wait_ready([self.agents[n] for n in nodes], _START_TIMEOUT)
        mirror = self.mirrored_modules()
        for node in nodes:
            self.fleet.hub.send(
                self.agents[node].id,
                Kind.BEGIN,
                {
                    "lid": self.lid,
                    "cwd": self.options.cwd,
                    "cwd_required": self.options.cwd_required,
                    "preload": sorted(set(self.preload)),
                    "mirror": mirror,
                    "sys_path": list(sys.path),  # where the kernel found them
                },
            )

    def mirrored_modules(self) -> list[str]:
        """The modules each host's server imports for this launch's ranks (``kernel_mirror``
        of the launch's setting)."""
        return kernel_mirror(self.setting)

    def _wait_for_launch(self, retry: bool) -> list[int]:
        """Every agent began the launch (READY); RuntimeError naming a host that cannot. With
        ``retry``, the nodes whose agent was lost come back instead (to be replaced)."""
        hosts = self.layout.hosts
        with self._changed:
            self._changed.wait_for(
                lambda: bool(self._lost) or len(self._ready) == len(hosts), _START_TIMEOUT
            )
            ready, lost = dict(self._ready), dict(self._lost)
        if lost and retry:
            return sorted(lost)
        for node, why in lost.items():
            raise RuntimeError(
                f"could not start the ranks on {hosts[node].name}: its agent was lost ({why})"
            )
        for node, header in ready.items():
            if header.get("error"):
                raise RuntimeError(
                    f"could not start the ranks on {hosts[node].name}: {header['error']}"
                )
        if len(ready) < len(hosts):
            names = [h.name for n, h in enumerate(hosts) if n not in ready]
            raise RuntimeError(
                f"the agents on {', '.join(names)} did not answer within {_START_TIMEOUT:.0f} s"
            )
        return []

    @property
    def master(self) -> tuple[str, int]:
        """``(MASTER_ADDR, MASTER_PORT)``: host 0 as the other hosts reach it, a free port."""
        hello = self.agents[0].hello
        assert hello is not None
        return hello["addr"], int(self._ready[0]["port"])

    def start(self, spec: WorkerSpec) -> RemoteProcess:
        assert self.fleet is not None, "prepare() first"
        self.fleet.hub.route(self.lid, spec.address)
        node, local = self.layout.place(spec.rank)
        host = self.layout.hosts[node]
        hello = self.agents[node].hello
        assert hello is not None
        ready = self._ready[node]
        process = RemoteProcess(
            spec.rank, host.name, self.name, self._signal, error_path=spec.error_path
        )
        with self._lock:
            self._processes[spec.rank] = process
            lost = self._lost.get(node)
        if lost:
            process.host_lost(lost)
            return process
        addr, port = self.master
        env = dict(hello["environ"])
        env.update(_launch_variables(spec.env))
        env.update(self.node_env(node))
        env.update(self.options.env)
        env.update(MASTER_ADDR=addr, MASTER_PORT=str(port), NBACCEL_HOST=host.name)
        host_spec = dataclasses.replace(
            spec,
            env=env,
            # the host's own path first, then the kernel's other entries (harmless where they do
            # not exist; on a shared filesystem they find the notebook's modules)
            sys_path=list(hello["sys_path"])
            + [p for p in spec.sys_path if p not in hello["sys_path"]],
            cwd=ready["cwd"],
            address=Address("unix", ready["entrance"], relayed=True),
            threads=self.rank_threads(node, int(hello["cpus"])),
            error_path=os.path.join(ready["private"], f"rank-{spec.rank}.error"),
            work=self._work_on(node, spec.work),
        )
        self._send(node, Kind.SPAWN, {"rank": spec.rank}, pickle.dumps(host_spec))
        return process

    def _send(self, node: int, kind: Kind, header: dict[str, Any], payload: bytes | None = None):
        if self.fleet is not None:
            self.fleet.hub.send(self.agents[node].id, kind, {"lid": self.lid, **header}, payload)

    def _work_on(self, node: int, work: Any) -> Any:
        """The work as ``node`` sees it: its shared tensors sent once, into the host's /dev/shm."""
        if not isinstance(work, Packed) or not work.segment:
            return work
        token = self._work_names.setdefault(id(work), secrets.token_hex(8))
        name = f"nbaccel-{token}-{node}"  # hosts may share a /dev/shm (several on one machine)
        if (node, name) not in self._work_sent:
            with open(work.segment, "rb") as handle:
                self._send(node, Kind.WORK, {"name": name}, handle.read())
            self._work_sent.add((node, name))
        hello = self.agents[node].hello
        assert hello is not None
        return dataclasses.replace(work, segment=os.path.join(hello["shm"], name))

    def place_work(self, work: Any, ranks: Iterable[int]) -> dict[int, Any]:
        return {rank: self._work_on(self.layout.place(rank)[0], work) for rank in ranks}

    def release_work(self) -> None:
        """Every rank mapped the shared tensors sent so far: each host removes its files."""
        by_node: dict[int, list[str]] = {}
        for node, name in self._work_sent:
            by_node.setdefault(node, []).append(name)
        self._work_sent.clear()
        self._work_names.clear()
        for node, names in by_node.items():
            self._send(node, Kind.UNLINK, {"names": names})

    def _signal(self, rank: int, sig: int, tree: bool) -> None:
        header = {"rank": rank, "signal": sig, "tree": tree}
        self._send(self.layout.place(rank)[0], Kind.SIGNAL, header)

    # ------------------------------------------------------------------ events (hub thread)
    def _on_event(self, agent: int, kind: Any, header: dict[str, Any]) -> None:
        with self._lock:
            node = self._node_of.get(agent)
            if node is None:
                return
            if kind == Kind.READY:
                self._ready[node] = header
                self._changed.notify_all()
                for text in header.get("notes", ()):
                    self._notices.append(f"{self.layout.hosts[node].name}: {text}")
            elif kind == Kind.STARTED:
                process = self._processes.get(int(header["rank"]))
                if process is not None:
                    process.started(int(header["pid"]))
            elif kind == Kind.EXITED:
                process = self._processes.get(int(header["rank"]))
                if process is not None:
                    process.exited(
                        int(header["code"]), float(header["at"]), header.get("detail", "")
                    )
            elif kind == Kind.LOG:
                self._notices.append(f"{self.layout.hosts[node].name}: {header.get('text', '')}")
            elif kind == Kind.LOST:
                self._lost[node] = header["why"]
                self._changed.notify_all()
                for rank, process in self._processes.items():
                    if self.layout.place(rank)[0] == node:
                        process.host_lost(header["why"])
        for wake in list(self._wakeups):
            wake()

    def take_notices(self) -> list[str]:
        with self._lock:
            notices, self._notices = self._notices, []
        return notices

    def add_wakeup(self, callback: Callable[[], None]) -> None:
        self._wakeups.append(callback)

    def remove_wakeup(self, callback: Callable[[], None]) -> None:
        if callback in self._wakeups:
            self._wakeups.remove(callback)

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        """End this launch on every host (what is left of its ranks is killed there); the
        agents stay for the next launch."""
        fleet, self.fleet = self.fleet, None
        if fleet is not None:
            fleet.close_session(self.lid, [h.id for h in self.agents])
        self._wakeups.clear()


_RANK_VARIABLES = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
     "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE"}
)  # fmt: skip


def _launch_variables(env: dict[str, str]) -> dict[str, str]:
    """What the launch set in a rank's environment (the rest is the host's own): the rank's
    variables, nbaccel's, Accelerate's launch contract, and whatever differs from this kernel's
    environment."""
    return {
        k: v
        for k, v in env.items()
        if k in _RANK_VARIABLES
        or k.startswith("NBACCEL_")
        or is_contract_variable(k)
        or os.environ.get(k) != v
    }


def _hosts(count: int) -> str:
    return f"{count} host" + ("s" if count != 1 else "")
