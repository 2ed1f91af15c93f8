"""The ``slurm`` launcher: one long-lived ``srun`` step per node of the allocation: its agent.

Used from a kernel that runs inside an allocation (``salloc``, ``sbatch``, or Jupyter started by
either). The first launch on a node starts its step (one task, ``--overlap`` so the ranks the
agent forks share the allocation), and the agent is kept for the kernel's life (``warm.py``).
The agent's configuration, keys included, is in the step's environment (``NBACCEL_AGENT_CONFIG``,
read and removed by the agent before anything starts), never on srun's command line. Each agent
stops its ranks and exits when the kernel's heartbeat stops; ``scancel`` of the allocation ends
the steps, and the next launch says the node's agent ended.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
from collections.abc import Hashable
from typing import Any

from nbaccel.launch.remote.hosts import Host
from nbaccel.launch.remote.launcher import AGENT_MODULE, RemoteLauncher, _route_address
from nbaccel.launch.remote.messages import CONFIG_VAR
from nbaccel.launch.remote.warm import AgentProcess
from nbaccel.launch.wire.protocol import LaunchKind

__all__ = ["SlurmLauncher"]


class SlurmLauncher(RemoteLauncher):
    """Ranks on the nodes of this kernel's SLURM allocation, through srun."""

    name = LaunchKind.SLURM

    def find_channel_address(self) -> str:
        """The local address on the route to the allocation's first node."""
        first = self.layout.hosts[0].name
        try:
            return _route_address(socket.gethostbyname(first))
        except OSError as exc:
            raise ValueError(
                f"cannot tell which address of this machine node {first} reaches ({exc}); pass "
                "channel_address='...' (an address of this machine the nodes can connect to)."
            ) from None

    def agent_key(self, host: Host) -> Hashable:
        job = os.environ.get("SLURM_JOB_ID", "")
        return ("slurm", job, host.name, self.options.python, self.options.srun_args)

    def start_agent(self, host: Host, config: dict[str, Any]) -> AgentProcess:
        env = dict(os.environ)
        env[CONFIG_VAR] = base64.b64encode(json.dumps(config).encode()).decode()
        argv = [
            "srun",
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={host.name}",
            "--kill-on-bad-exit=1",
            "--overlap",
            "--export=ALL",
            f"--chdir={self.options.cwd}",
            *self.options.srun_args,
            self.options.python,
            "-m",
            AGENT_MODULE,
        ]
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        return AgentProcess(popen, f"srun on {host.name}")
