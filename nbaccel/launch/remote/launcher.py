"""Ranks on other hosts: the launcher variant shared by ``ssh`` and ``slurm``.

``prepare`` binds the hub (``hub.py``) on the address the hosts reach, starts one agent per host
(``ssh.py``: one ``ssh host python -m nbaccel.launch.remote.agent`` each; ``slurm.py``: one
``srun`` with a task per node), hands each agent its keys over ssh's stdin or the job's
environment, and waits for every agent's hello. ``start`` then turns the worker group's spec
into the host's (its paths, its environment plus the launch's variables, the address of the
agent's tunnel, the shared tensors in its /dev/shm), which the agent hands unchanged to its
fork server. Host 0's agent chose ``MASTER_PORT``; its address is ``MASTER_ADDR``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import secrets
import socket
import subprocess
import threading
import time
from abc import abstractmethod
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from nbaccel.launch.channel import Address
from nbaccel.launch.launchers.base import ProcessLauncher
from nbaccel.launch.remote.hub import Hub
from nbaccel.launch.remote.options import RemoteOptions
from nbaccel.launch.remote.process import RemoteProcess
from nbaccel.launch.remote.wire import Kind
from nbaccel.launch.spec import WorkerSpec
from nbaccel.launch.transport import Packed

__all__ = ["AgentProcess", "RemoteLauncher"]

_START_TIMEOUT = 120.0
AGENT_MODULE = "nbaccel.launch.remote.agent"


@dataclass
class AgentProcess:
    """A local process (``ssh`` or ``srun``) that runs the agents of ``nodes``."""

    popen: subprocess.Popen
    nodes: list[int]
    what: str  # "ssh nbh1", "srun"
    tail: deque = field(default_factory=lambda: deque(maxlen=20))
    reader: threading.Thread | None = None  # keeps ``tail``; ends with the process's output

    def why_ended(self, wait: float = 2.0) -> str:
        """What the ended process said last, once its output was read (at most ``wait`` s:
        a child of it may hold the pipe open)."""
        if self.reader is not None:
            self.reader.join(wait)
        code = self.popen.poll()
        said = " | ".join(line for line in self.tail if line.strip())
        return f"{self.what} exited with code {code}" + (f": {said}" if said else "")


def _route_address(target: str) -> str:
    """This machine's address on the route to ``target`` (an address or a name)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((target, 9))  # sends nothing: only picks the route
        return probe.getsockname()[0]


class RemoteLauncher(ProcessLauncher):
    """Start ranks through one agent per host; subclasses say how agents start."""

    pickles_work = True
    local_memory = False

    def __init__(self, preload: Iterable[str] = (), remote: RemoteOptions | None = None) -> None:
        super().__init__(preload)
        if remote is None:
            raise ValueError(f"the {self.name} launcher needs the hosts (RemoteOptions).")
        self.options = remote
        self.layout = remote.layout
        self.channel_address = remote.channel_address or self.find_channel_address()
        self.hub: Hub | None = None
        self.agents: list[AgentProcess] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a hello, or an agent process ended
        self._hello: dict[int, dict[str, Any]] = {}
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
    def start_agents(self, configs: list[dict[str, Any]]) -> list[AgentProcess]:
        """Start the agents, one per node, each with ``configs[node]`` (kept off argv)."""

    # ------------------------------------------------------------------ the interface
    @property
    def hosts_by_rank(self) -> dict[int, str]:
        return {r: self.layout.host_of(r).name for r in range(self.layout.num_processes)}

    def describe(self) -> str:
        return (
            f" on {_hosts(len(self.layout.hosts))} ({self.layout.describe()}) over "
            f"{self.options.kind}; their agents connect back to {self.channel_address} "
            "(ZeroMQ CURVE: encrypted, only this launch's keys admitted)"
        )

    def prepare(self) -> None:
        if self.hub is not None:
            return
        nodes = len(self.layout.hosts)
        self.hub = Hub(self.channel_address, nodes, self._on_event)
        configs = [
            {
                "node": node,
                "name": host.name,
                "hub": f"tcp://{self.channel_address}:{self.hub.port}",
                "server_key": self.hub.server_public,
                "public": self.hub.agent_keys[node][0],
                "secret": self.hub.agent_keys[node][1],
                "cwd": self.options.cwd,
                "cwd_required": self.options.cwd_required,
                "preload": sorted(set(self.preload)),
            }
            for node, host in enumerate(self.layout.hosts)
        ]
        try:
            self.agents = self.start_agents(configs)
            for agent in self.agents:
                agent.reader = threading.Thread(
                    target=_collect, args=(agent,), daemon=True, name="nbaccel-agent-out"
                )
                agent.reader.start()
                threading.Thread(
                    target=self._watch_agent, args=(agent,), daemon=True, name="nbaccel-agent"
                ).start()
            self._wait_for_agents()
        except BaseException:
            self.close()
            raise

    def _wait_for_agents(self) -> None:
        hosts = self.layout.hosts
        with self._changed:
            self._changed.wait_for(
                lambda: (
                    len(self._hello) == len(hosts)
                    or any(agent.popen.poll() is not None for agent in self.agents)
                ),
                _START_TIMEOUT,
            )
            waiting = [n for n in range(len(hosts)) if n not in self._hello]
        if not waiting:
            return
        for agent in self.agents:
            if agent.popen.poll() is not None:
                names = ", ".join(hosts[n].name for n in agent.nodes)
                raise RuntimeError(
                    f"could not start nbaccel's agent on {names}: {agent.why_ended()}"
                )
        names = ", ".join(hosts[n].name for n in waiting)
        raise RuntimeError(
            f"the agents on {names} did not connect back to {self.channel_address} within "
            f"{_START_TIMEOUT:.0f} s: can those hosts reach this address? Pass "
            "channel_address=... to choose another one."
        )

    def _watch_agent(self, agent: AgentProcess) -> None:
        """An agent process that ends takes its hosts with it: name them at once (with its
        last words)."""
        agent.popen.wait()
        with self._changed:
            self._changed.notify_all()
        why = f"its agent ended ({agent.why_ended()})"
        hub = self.hub
        if hub is not None:  # not closed
            for node in agent.nodes:
                hub.lose(node, why)

    @property
    def master(self) -> tuple[str, int]:
        """``(MASTER_ADDR, MASTER_PORT)``: host 0 as the other hosts reach it, a free port."""
        hello = self._hello[0]
        return hello["addr"], int(hello["port"])

    def start(self, spec: WorkerSpec) -> RemoteProcess:
        assert self.hub is not None, "prepare() first"
        self.hub.channel = spec.address
        node, local = self.layout.place(spec.rank)
        host = self.layout.hosts[node]
        hello = self._hello[node]
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
        env.update(self.options.env)
        env.update(MASTER_ADDR=addr, MASTER_PORT=str(port), NBACCEL_HOST=host.name)
        host_spec = dataclasses.replace(
            spec,
            env=env,
            # the host's own path first, then the kernel's other entries (harmless where they do
            # not exist; on a shared filesystem they find the notebook's modules)
            sys_path=list(hello["sys_path"])
            + [p for p in spec.sys_path if p not in hello["sys_path"]],
            cwd=hello["cwd"],
            address=Address("unix", hello["entrance"]),
            threads=max(1, int(hello["cpus"]) // host.slots),
            error_path=os.path.join(hello["private"], f"rank-{spec.rank}.error"),
            work=self._work_on(node, spec.work),
        )
        self.hub.send(node, Kind.SPAWN, {"rank": spec.rank}, pickle.dumps(host_spec))
        return process

    def _work_on(self, node: int, work: Any) -> Any:
        """The work as ``node`` sees it: its shared tensors sent once, into the host's /dev/shm."""
        if not isinstance(work, Packed) or not work.segment:
            return work
        token = self._work_names.setdefault(id(work), secrets.token_hex(8))
        name = f"nbaccel-{token}-{node}"  # hosts may share a /dev/shm (several on one machine)
        if (node, name) not in self._work_sent:
            assert self.hub is not None
            with open(work.segment, "rb") as handle:
                self.hub.send(node, Kind.WORK, {"name": name}, handle.read())
            self._work_sent.add((node, name))
        return dataclasses.replace(work, segment=os.path.join(self._hello[node]["shm"], name))

    def place_work(self, work: Any, ranks: Iterable[int]) -> dict[int, Any]:
        return {rank: self._work_on(self.layout.place(rank)[0], work) for rank in ranks}

    def release_work(self) -> None:
        """Every rank mapped the shared tensors sent so far: each host removes its files."""
        by_node: dict[int, list[str]] = {}
        for node, name in self._work_sent:
            by_node.setdefault(node, []).append(name)
        self._work_sent.clear()
        self._work_names.clear()
        if self.hub is not None:
            for node, names in by_node.items():
                self.hub.send(node, Kind.UNLINK, {"names": names})

    def _signal(self, rank: int, sig: int) -> None:
        if self.hub is not None:
            self.hub.send(self.layout.place(rank)[0], Kind.SIGNAL, {"rank": rank, "signal": sig})

    # ------------------------------------------------------------------ events (hub thread)
    def _on_event(self, node: int, kind: Any, header: dict[str, Any]) -> None:
        with self._changed:
            if kind == Kind.HELLO:
                self._hello[node] = header
                self._changed.notify_all()
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
        """Tell every agent to stop its ranks and exit; end the agent processes and the hub."""
        hub, self.hub = self.hub, None
        if hub is not None:
            for node in range(len(self.layout.hosts)):
                hub.send(node, Kind.QUIT)
        deadline = time.monotonic() + 3.0
        for agent in self.agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.popen.wait(max(0.0, deadline - 2.0 - time.monotonic()))  # QUIT first
            with contextlib.suppress(OSError):
                agent.popen.stdin and agent.popen.stdin.close()
            try:
                agent.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                agent.popen.terminate()
                try:
                    agent.popen.wait(2.0)
                except subprocess.TimeoutExpired:
                    agent.popen.kill()
                    agent.popen.wait()
        if hub is not None:
            hub.close()
        self._wakeups.clear()


_RANK_VARIABLES = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK"}
)


def _launch_variables(env: dict[str, str]) -> dict[str, str]:
    """What the launch set in a rank's environment (the rest is the host's own): the rank's
    variables, nbaccel's, and whatever differs from this kernel's environment."""
    return {
        k: v
        for k, v in env.items()
        if k in _RANK_VARIABLES or k.startswith("NBACCEL_") or os.environ.get(k) != v
    }


def _collect(agent: AgentProcess) -> None:
    """Keep the last lines the agent process printed (ssh's errors, the agent's log)."""
    stream = agent.popen.stdout
    if stream is None:
        return
    for raw in iter(stream.readline, b""):
        agent.tail.append(raw.decode("utf-8", "replace").rstrip())
    stream.close()


def _hosts(count: int) -> str:
    return f"{count} host" + ("s" if count != 1 else "")
