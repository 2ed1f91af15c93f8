"""The ``slurm`` launcher: one ``srun`` with one agent task per node of the allocation.

Used from a kernel that runs inside an allocation (``salloc``, ``sbatch``, or Jupyter started by
either). The agents' configuration, keys included, is in the job step's environment
(``NBACCEL_AGENT_CONFIG``, read and removed by each agent before anything starts), never on
srun's command line. srun ends every agent when one fails (``--kill-on-bad-exit``); each agent
stops its ranks when the kernel's heartbeat stops.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
from typing import Any

from nbaccel.launch.protocol import LaunchKind
from nbaccel.launch.remote.launcher import (
    AGENT_MODULE,
    AgentProcess,
    RemoteLauncher,
    _route_address,
)
from nbaccel.launch.remote.wire import CONFIG_VAR

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

    def start_agents(self, configs: list[dict[str, Any]]) -> list[AgentProcess]:
        shared = {
            k: v for k, v in configs[0].items() if k not in ("node", "name", "public", "secret")
        }
        shared["nodes"] = [
            {"name": c["name"], "public": c["public"], "secret": c["secret"]} for c in configs
        ]
        env = dict(os.environ)
        env[CONFIG_VAR] = base64.b64encode(json.dumps(shared).encode()).decode()
        nodes = str(len(configs))
        argv = [
            "srun",
            f"--nodes={nodes}",
            f"--ntasks={nodes}",
            "--ntasks-per-node=1",
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
        return [AgentProcess(popen, list(range(len(configs))), "srun")]
