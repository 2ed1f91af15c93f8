"""The ``ray`` launcher: the ranks on a Ray cluster's nodes, one agent per node in an actor.

It is the remote variant of ssh and SLURM (``nbaccel.launch.remote.launcher``) with two
differences. Where the ranks run is Ray's choice: :meth:`RayLauncher.placed` (called when the
plan is made, before anything starts) leases an allocation (``allocation.py``: a placement group
and one keeper actor per rank) and its nodes become the launch's hosts. And each node's agent is
started by that node's first keeper, not by ssh or srun, so it lives exactly as long as the
reservation. A node's ranks see the GPUs Ray assigned to its keepers (``CUDA_VISIBLE_DEVICES``,
in local-rank order, so ``LOCAL_RANK`` indexes them).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Hashable, Iterable
from typing import Any

from nbaccel.launch.launchers.forkserver.kernel_modules import PreloadSetting
from nbaccel.launch.remote.hosts import Host
from nbaccel.launch.remote.launcher import RemoteLauncher
from nbaccel.launch.remote.options import RemoteOptions
from nbaccel.launch.remote.warm import AgentProcess
from nbaccel.launch.wire.protocol import LaunchKind

__all__ = ["RayLauncher"]


class RayLauncher(RemoteLauncher):
    """Ranks on a Ray cluster, placed by a placement group; agents run by keeper actors."""

    name = LaunchKind.RAY

    def __init__(
        self,
        preload: Iterable[str] = (),
        remote: RemoteOptions | None = None,
        setting: PreloadSetting | None = None,
    ) -> None:
        from nbaccel.launch.remote.ray.allocation import find

        if remote is None or remote.ray is None:
            raise ValueError("the ray launcher needs the Ray options (RemoteOptions.ray).")
        if remote.layout is None:
            remote = self.placed(remote, pool=False)
        self.allocation = find(remote.allocation)
        if self.allocation is None:  # released since the plan was made (a pool's restart)
            remote = self._placed_again(remote)
        super().__init__(preload, remote, setting)

    # ------------------------------------------------------------------ placement
    @classmethod
    def placed(cls, remote: RemoteOptions, pool: bool) -> RemoteOptions:
        """``remote`` with its ranks placed on the cluster: its layout is the allocation's
        nodes. Refuses (ValueError) a cluster that cannot hold them, before anything starts."""
        from nbaccel.launch.remote.ray.allocation import lease

        assert remote.ray is not None
        count = remote.num_processes or (2 if pool else 1)
        allocation = lease(remote.ray, count, pool)
        return dataclasses.replace(remote, layout=allocation.layout, allocation=allocation.id)

    def _placed_again(self, remote: RemoteOptions) -> RemoteOptions:
        from nbaccel.launch.remote.ray.allocation import find

        again = self.placed(remote, pool=True)
        if again.layout != remote.layout:
            allocation = find(again.allocation)
            if allocation is not None:
                allocation.release()
            raise RuntimeError(
                f"the Ray cluster placed the ranks on other nodes this time "
                f"({again.layout.describe() if again.layout else '?'} instead of "
                f"{remote.layout.describe() if remote.layout else '?'}): start a new pool."
            )
        self.allocation = find(again.allocation)
        return again

    # ------------------------------------------------------------------ RemoteLauncher
    def find_channel_address(self) -> str:
        """This kernel's address as the Ray cluster knows it."""
        assert self.allocation is not None
        return str(self.allocation.ray.util.get_node_ip_address())

    def agent_key(self, host: Host) -> Hashable:
        assert self.allocation is not None
        return ("ray", self.allocation.id, host.name)

    def start_agent(self, host: Host, config: dict[str, Any]) -> AgentProcess:
        from nbaccel.launch.remote.ray.actor_process import ActorPopen, ray_call

        allocation = self.allocation
        assert allocation is not None
        node = [h.name for h in self.layout.hosts].index(host.name)
        keeper = allocation.node_keeper(node)
        ray_call(keeper.start_agent, config, self.options.python, self.options.cwd)
        tail: deque = deque(maxlen=20)
        popen = ActorPopen(allocation.ray, keeper, host.name, tail)
        return AgentProcess(popen, f"the agent on Ray node {host.name}", tail=tail)  # type: ignore[arg-type]

    def node_env(self, node: int) -> dict[str, str]:
        assert self.allocation is not None
        gpus = self.allocation.gpus[node]
        return (
            {"CUDA_VISIBLE_DEVICES": ",".join(gpus)}
            if self.options.ray and self.options.ray.gpus
            else {}
        )

    def rank_threads(self, node: int, cpus: int) -> int:
        """The CPUs each rank reserved (at least one), not a share of the whole node: the node's
        other CPUs belong to other jobs."""
        assert self.options.ray is not None
        reserved = int(self.options.ray.resources.get("CPU", 1.0))
        return max(1, min(reserved, cpus))

    def describe(self) -> str:
        ray = self.options.ray
        assert ray is not None and self.allocation is not None
        count = len(self.layout.hosts)
        return (
            f" on {count} Ray node{'s' if count != 1 else ''} ({self.layout.describe()}; "
            f"{ray.describe()}); their agents connect back to {self.channel_address} "
            "(ZeroMQ CURVE: encrypted, only this kernel's agent keys admitted)"
        )

    def prepare(self) -> None:
        from nbaccel.launch.remote.ray.allocation import find

        if self.fleet is None and (self.allocation is None or find(self.allocation.id) is None):
            self.options = self._placed_again(self.options)
        super().prepare()

    def close(self) -> None:
        """End the launch on every node; then give the allocation back (removed, or kept warm
        for the next launch: see ``allocation.py``)."""
        from nbaccel.launch.remote.ray.allocation import give_back

        with self._lock:
            lost = "; ".join(f"{self.layout.hosts[n].name}: {why}" for n, why in self._lost.items())
        lost = lost or "; ".join(f"{h.name}: {h.lost}" for h in self.agents if h.lost)
        super().close()
        if self.allocation is not None:
            give_back(self.allocation, lost)
