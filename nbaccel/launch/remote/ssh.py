"""The ``ssh`` launcher: one ``ssh host python -m nbaccel.launch.remote.agent`` per host.

The agent is started by the first launch on its host and kept for the kernel's life
(``warm.py``). Everything ssh knows applies (``~/.ssh/config``: users, ports, identities, jump
hosts); extra arguments come from ``ssh_args``. The agent's configuration, keys included, is
written to ssh's stdin, which then stays open: when this kernel dies, the pipe closes, ssh passes
the end of input on, and the agent stops its ranks and exits. ssh runs in its own session, so
the notebook's stop button (SIGINT to the kernel's process group) reaches the ranks through the
kernel, not by killing ssh.
"""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
from collections.abc import Hashable
from typing import Any

from nbaccel.launch.remote.hosts import Host
from nbaccel.launch.remote.launcher import AGENT_MODULE, RemoteLauncher, _route_address
from nbaccel.launch.remote.warm import AgentProcess
from nbaccel.launch.wire.protocol import LaunchKind

__all__ = ["SSH_CONNECT_TIMEOUT", "SshLauncher"]

#: seconds ssh waits for a host to answer before it gives up (ssh's ConnectTimeout)
SSH_CONNECT_TIMEOUT = 10


class SshLauncher(RemoteLauncher):
    """Ranks on the hosts of ``hosts=[...]``, through ssh."""

    name = LaunchKind.SSH

    def _ssh(self, *args: str) -> list[str]:
        # a host that does not answer is named within SSH_CONNECT_TIMEOUT seconds, not after
        # the system's TCP timeout (minutes); a ConnectTimeout in ssh_args comes first and wins
        return [
            "ssh",
            *self.options.ssh_args,
            "-T",
            "-o",
            "BatchMode=yes",
            "-o",
            f"ConnectTimeout={SSH_CONNECT_TIMEOUT}",
            *args,
        ]

    def find_channel_address(self) -> str:
        """The local address on the route to the first host (as ``ssh -G`` resolves it)."""
        host = self.layout.hosts[0]
        target = host.name
        try:
            out = subprocess.run(
                self._ssh("-G", host.target), capture_output=True, text=True, timeout=10
            ).stdout
            for line in out.splitlines():
                key, _, value = line.partition(" ")
                if key == "hostname" and value:
                    target = value.strip()
        except (OSError, subprocess.SubprocessError):
            pass
        try:
            return _route_address(socket.gethostbyname(target))
        except OSError as exc:
            raise ValueError(
                f"cannot tell which address of this machine host {host.name} reaches "
                f"({target}: {exc}); pass channel_address='...' (an address of this machine "
                "the hosts can connect to)."
            ) from None

    def agent_key(self, host: Host) -> Hashable:
        return ("ssh", host.target, self.options.python, self.options.ssh_args)

    def start_agent(self, host: Host, config: dict[str, Any]) -> AgentProcess:
        python = shlex.quote(self.options.python)
        cwd = shlex.quote(self.options.cwd)
        command = f"cd {cwd} 2>/dev/null; exec {python} -m {AGENT_MODULE}"
        popen = subprocess.Popen(
            self._ssh(host.target, command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert popen.stdin is not None
        popen.stdin.write(json.dumps(config).encode() + b"\n")
        popen.stdin.flush()
        return AgentProcess(popen, f"ssh {host.target}")
