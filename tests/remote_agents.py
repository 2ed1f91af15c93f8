"""Agents on this machine for the default suite: the remote launch without ssh or srun.

``LocalAgentsLauncher`` starts each "host"'s agent (once; it stays warm, like the lanes' agents)
as a real subprocess
(``python -m nbaccel.launch.remote.agent``, configuration on its stdin, as ssh would deliver it)
that connects to the CURVE hub on 127.0.0.1. Everything but the transport that starts the agent
is the real thing; the ssh and SLURM transports themselves are tested in the lanes
(``tests/hosts``).
"""

from __future__ import annotations

import json
import subprocess
import sys

from nbaccel.launch.plan import LaunchPlan
from nbaccel.launch.registry import LAUNCHERS
from nbaccel.launch.remote.hosts import parse_hosts
from nbaccel.launch.remote.launcher import AGENT_MODULE, RemoteLauncher
from nbaccel.launch.remote.options import RemoteOptions
from nbaccel.launch.remote.warm import AgentProcess
from nbaccel.launch.request import Front, LaunchRequest

KIND = "local-agents"


class LocalAgentsLauncher(RemoteLauncher):
    name = KIND

    def find_channel_address(self) -> str:
        return "127.0.0.1"

    def agent_key(self, host):
        return (KIND, host.name, sys.executable)

    def start_agent(self, host, config):
        popen = subprocess.Popen(
            [sys.executable, "-m", AGENT_MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        popen.stdin.write(json.dumps(config).encode() + b"\n")
        popen.stdin.flush()
        return AgentProcess(popen, f"agent {host.name}")


LAUNCHERS[KIND] = LocalAgentsLauncher


def local_plan(hosts: list[str], front: Front = Front.LAUNCHER) -> LaunchPlan:
    """A plan whose "hosts" are agents on this machine."""
    layout = parse_hosts(hosts, None)
    remote = RemoteOptions(kind=KIND, layout=layout, python=sys.executable, cwd="/")
    request = LaunchRequest(num_processes=layout.num_processes, cpu=True)
    return LaunchPlan.create(front, request, remote=remote)
