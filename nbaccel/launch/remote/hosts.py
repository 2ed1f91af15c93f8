"""Which hosts a launch spreads over, and which ranks each one runs.

``hosts=["node1:4", "node2:4"]`` (SSH) or a SLURM allocation's nodes become one
:class:`HostLayout`: the hosts in order, each with its number of ranks. Ranks are numbered host
by host (node1 runs ranks 0-3, node2 ranks 4-7), so a host's NODE_RANK is its position and its
ranks' LOCAL_RANK their position on it. Everything here is checked before anything starts.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from nbaccel.launch.remote.reachable import check_slurm_allocation

__all__ = ["Host", "HostLayout", "parse_hosts", "slurm_layout"]

_HOST = re.compile(r"^(?:(?P<user>[A-Za-z0-9._-]+)@)?(?P<name>[A-Za-z0-9._-]+)(?::(?P<slots>.*))?$")


@dataclass(frozen=True)
class Host:
    """One host: where ssh (or srun) goes, and how many ranks it runs."""

    name: str  # as ssh knows it (an alias of ~/.ssh/config works); the label in outputs
    slots: int
    user: str | None = None

    @property
    def target(self) -> str:
        """``[user@]name`` for ssh."""
        return f"{self.user}@{self.name}" if self.user else self.name


@dataclass(frozen=True)
class HostLayout:
    """The hosts of a launch, in rank order."""

    hosts: tuple[Host, ...]

    @property
    def num_processes(self) -> int:
        return sum(h.slots for h in self.hosts)

    def place(self, rank: int) -> tuple[int, int]:
        """``(node_rank, local_rank)`` of global ``rank``."""
        start = 0
        for node, host in enumerate(self.hosts):
            if rank < start + host.slots:
                return node, rank - start
            start += host.slots
        raise IndexError(f"rank {rank} is beyond the {self.num_processes} ranks of the hosts")

    def host_of(self, rank: int) -> Host:
        return self.hosts[self.place(rank)[0]]

    def describe(self) -> str:
        """``nbh1:2, nbh2:2``."""
        return ", ".join(f"{h.name}:{h.slots}" for h in self.hosts)


def _fail(message: str) -> None:
    raise ValueError(message)


def parse_hosts(hosts: str | Sequence[str], num_processes: int | None) -> HostLayout:
    """The layout of ``hosts`` (``["node1:4", "user@node2:4"]`` or ``"node1:4,node2:4"``).

    A host without ``:N`` gets an even share of ``num_processes``. The totals must agree.
    """
    if isinstance(hosts, str):
        hosts = [h for h in hosts.split(",") if h.strip()]
    if not isinstance(hosts, (list, tuple)) or not hosts:
        _fail(
            f"hosts must be a non-empty list such as ['node1:4', 'node2:4'] (host name, then "
            f"':' and its number of ranks), got {hosts!r}."
        )
    parsed: list[tuple[str | None, str, int | None]] = []
    for entry in hosts:
        match = _HOST.match(str(entry).strip()) if isinstance(entry, str) else None
        if match is None:
            _fail(
                f"hosts entry {entry!r} is not '[user@]host[:N]' (letters, digits, '.', '_' "
                "and '-' only; ssh port, identity or jump host go in ~/.ssh/config or "
                "ssh_args=[...])."
            )
        slots = match.group("slots")
        if slots is not None and (not slots.isdigit() or int(slots) < 1):
            _fail(
                f"hosts entry {entry!r}: the number of ranks after ':' must be a positive integer."
            )
        parsed.append(
            (match.group("user"), match.group("name"), None if slots is None else int(slots))
        )
    names = [name for _, name, _ in parsed]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        _fail(
            f"hosts names {', '.join(duplicates)} more than once; give each host once with its "
            "number of ranks ('node1:4')."
        )
    given = [s for _, _, s in parsed if s is not None]
    missing = len(parsed) - len(given)
    if missing:
        if num_processes is None:
            _fail(
                "give each host its number of ranks ('node1:4') or pass num_processes to share "
                "them evenly."
            )
        rest = num_processes - sum(given)
        if rest < missing or rest % missing:
            _fail(
                f"num_processes={num_processes} cannot be shared evenly among the "
                f"{missing} host(s) without ':N' (after {sum(given)} given); write each host's "
                "ranks explicitly ('node1:4')."
            )
        parsed = [(u, n, s if s is not None else rest // missing) for u, n, s in parsed]
    layout = HostLayout(tuple(Host(name, slots, user) for user, name, slots in parsed))
    if num_processes is not None and layout.num_processes != num_processes:
        _fail(
            f"num_processes={num_processes} but the hosts add up to {layout.num_processes} ranks "
            f"({layout.describe()}); make them agree, or leave num_processes out."
        )
    return layout


def _expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed node list (``node[1-3],gpu7``) as names, through ``scontrol``."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(
            f"could not expand the allocation's node list {nodelist!r} with scontrol: {exc}"
        ) from None
    return out.split()


def slurm_layout(num_processes: int | None, environ: dict[str, str] | None = None) -> HostLayout:
    """The nodes of the SLURM allocation this kernel runs in, with an even share of ranks.

    ``num_processes`` defaults to the allocation's tasks (``SLURM_NTASKS``), else one per node.
    An allocation that is not running, or a controller that does not answer, is refused first
    (``reachable.check_slurm_allocation``).
    """
    env = os.environ if environ is None else environ
    if not env.get("SLURM_JOB_ID"):
        _fail(
            "launcher='slurm' runs inside a SLURM allocation, and SLURM_JOB_ID is not set: start "
            "Jupyter (or this kernel) under salloc or sbatch, or use hosts=[...] over ssh."
        )
    check_slurm_allocation(env["SLURM_JOB_ID"])
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    nodes = _expand_nodelist(nodelist) if nodelist else []
    if not nodes:
        _fail("the SLURM allocation names no nodes (SLURM_JOB_NODELIST is empty).")
    if num_processes is None:
        tasks = env.get("SLURM_NTASKS", "")
        num_processes = int(tasks) if tasks.isdigit() else len(nodes)
    if num_processes < len(nodes) or num_processes % len(nodes):
        _fail(
            f"num_processes={num_processes} cannot be shared evenly among the allocation's "
            f"{len(nodes)} node(s) ({', '.join(nodes)}); use a multiple of {len(nodes)}."
        )
    per = num_processes // len(nodes)
    return HostLayout(tuple(Host(node, per) for node in nodes))
