"""A real Ray cluster on this machine for the tests: a head and more nodes, each its own
``ray start --block`` process with its own temporary folder and ports.

The tests start and stop it by their own handles: :meth:`RayCluster.stop` ends the ``ray start``
processes it started (each stops its node's processes), never ``ray stop``, which would end
every Ray process on the machine. :meth:`RayCluster.kill_node` SIGKILLs one node's raylet: a
node dying as a machine does. The nodes' workers inherit this process's environment
(``PYTHONPATH`` included), so they import the nbaccel under test.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

__all__ = ["RayCluster"]

_RAY_SCRIPT = os.path.join(os.path.dirname(sys.executable), "ray")
# `ray start` by its console script where pip wrote one, else by Ray's own entry point (an image
# that ships the package without its scripts, as some CUDA images do).
_RAY_MAIN = "import sys\nfrom ray.scripts.scripts import main\nsys.exit(main())"
_RAY = [_RAY_SCRIPT] if os.path.exists(_RAY_SCRIPT) else [sys.executable, "-c", _RAY_MAIN]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _ports() -> list[str]:
    """A node's own ports (two nodes on one machine must not share Ray's fixed defaults)."""
    flags = [
        "--node-manager-port",
        "--object-manager-port",
        "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port",
        "--runtime-env-agent-port",
        "--metrics-export-port",
    ]
    return [item for flag in flags for item in (flag, str(_free_port()))]


@dataclass
class RayCluster:
    """``cpus`` per node (the first is the head); ``gpus`` on the head."""

    cpus: tuple[int, ...] = (2, 2)
    gpus: int = 0
    object_store: int = 80 * 1024 * 1024
    address: str = ""
    root: str = ""
    processes: list[subprocess.Popen] = field(default_factory=list)
    node_manager_ports: list[int] = field(default_factory=list)  # by node: tells nodes apart

    def start(self, timeout: float = 120.0, attempts: int = 3) -> RayCluster:
        """Start the nodes; again (at most ``attempts`` times in all) when a raylet aborted
        because its dashboard agent, a Python process, did not write its port file within
        Ray's fixed 15 s (a loaded machine; not a setting of Ray's)."""
        for attempt in range(1, attempts + 1):
            try:
                return self._start(timeout)
            except BaseException:
                slow_agent = self._agent_too_slow()
                self.stop()
                if not slow_agent or attempt == attempts:
                    raise
                print(
                    "RayCluster: a raylet gave up waiting for its dashboard agent's port file "
                    f"(attempt {attempt} of {attempts}); starting the cluster again",
                    file=sys.stderr,
                )
        raise AssertionError("unreachable")

    def _agent_too_slow(self) -> bool:
        pattern = os.path.join(self.root or "/nonexistent", "n*", "session_*", "logs", "raylet.*")
        for path in glob.glob(pattern):
            with contextlib.suppress(OSError), open(path, "rb") as log:
                text = log.read()
                if b"Timed out waiting for file" in text and b"_port" in text:
                    return True
        return False

    def _start(self, timeout: float) -> RayCluster:
        self.root = tempfile.mkdtemp(prefix="nbray-", dir="/tmp")  # short: Ray's socket paths
        port = _free_port()
        self.address = f"127.0.0.1:{port}"
        common = ["--block", "--disable-usage-stats", f"--object-store-memory={self.object_store}"]
        head = [*_RAY, "start", "--head", f"--port={port}", "--include-dashboard=false"]
        head += [f"--dashboard-port={_free_port()}"]
        if importlib.util.find_spec("grpc") is not None:  # Ray Client's port: ray[client] only
            head += [f"--ray-client-server-port={_free_port()}"]
        head += [f"--num-gpus={self.gpus}"]
        self._node(head + common, 0)
        self._wait_port(port, timeout)
        # The head's GCS listens before its raylet registers the head node; a node joining
        # in between finds "no node info for head node" and exits (seen on a loaded machine).
        self.wait_nodes(1, timeout)
        for index in range(1, len(self.cpus)):
            worker = [*_RAY, "start", f"--address={self.address}", "--num-gpus=0"]
            self._node([*worker, *common], index)
        self.wait_nodes(len(self.cpus), timeout)
        return self

    def _node(self, argv: list[str], index: int) -> None:
        folder = os.path.join(self.root, f"n{index}")
        os.makedirs(folder)
        log = open(os.path.join(self.root, f"node{index}.log"), "wb")  # noqa: SIM115
        ports = _ports()
        self.node_manager_ports.append(int(ports[1]))
        argv = [*argv, f"--num-cpus={self.cpus[index]}", f"--temp-dir={folder}", *ports]
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
        env.pop("RAY_ADDRESS", None)
        self.processes.append(
            subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        )
        log.close()

    def _wait_port(self, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.processes[0].poll() is not None:
                raise RuntimeError(f"ray start --head ended: {self.log(0)}")
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                return
            time.sleep(0.2)
        raise TimeoutError(f"the Ray head did not listen within {timeout} s: {self.log(0)}")

    def wait_nodes(self, count: int, timeout: float = 120.0) -> None:
        """Until ``count`` nodes are alive (asked in a child process: this one stays free of
        any Ray connection)."""
        code = (
            "import ray,time,sys\n"
            f"ray.init(address={self.address!r}, logging_level='ERROR', log_to_driver=False)\n"
            f"t=time.monotonic()+{timeout}\n"
            f"while sum(n['Alive'] for n in ray.nodes())<{count} and time.monotonic()<t:\n"
            "    time.sleep(0.2)\n"
            f"sys.exit(0 if sum(n['Alive'] for n in ray.nodes())>={count} else 1)\n"
        )
        asking = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + timeout + 60
        while asking.poll() is None:
            ended = [i for i, p in enumerate(self.processes) if p.poll() is not None]
            if ended or time.monotonic() > deadline:  # a node gave up: no use waiting for it
                asking.kill()
                asking.wait()
                why = f"node {ended[0]} ended: {self.log(ended[0])}" if ended else "timed out"
                raise RuntimeError(f"the Ray cluster has not {count} nodes: {why}")
            time.sleep(0.2)
        if asking.returncode:
            stderr = asking.stderr.read() if asking.stderr else b""
            raise RuntimeError(f"the Ray cluster has not {count} nodes: {stderr[-2000:]!r}")

    def log(self, index: int) -> str:
        with (
            contextlib.suppress(OSError),
            open(os.path.join(self.root, f"node{index}.log"), "rb") as f,
        ):
            return f.read()[-3000:].decode("utf-8", "replace")
        return ""

    def raylet_pid(self, index: int) -> int:
        """The raylet of node ``index`` (a child of its ``ray start``)."""
        for line in subprocess.run(
            ["ps", "-o", "pid=,ppid=,comm=", "-e"], capture_output=True, text=True
        ).stdout.splitlines():
            pid, ppid, comm = line.split(None, 2)
            if int(ppid) == self.processes[index].pid and comm.strip() == "raylet":
                return int(pid)
        raise LookupError(f"node {index} has no raylet")

    def kill_node(self, index: int) -> None:
        """SIGKILL node ``index``'s raylet: the node dies (its workers end with it)."""
        os.kill(self.raylet_pid(index), signal.SIGKILL)

    def stop(self) -> None:
        """End the nodes this cluster started (workers first, the head last): each node's
        processes are its ``ray start``'s process group (a session of its own), SIGKILLed at
        once. Disconnect any driver first (``ray.shutdown()``): a driver whose cluster vanished
        ends its process after a minute."""
        for process in reversed(self.processes):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        self.processes.clear()
        self.node_manager_ports.clear()
        if self.root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> RayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
