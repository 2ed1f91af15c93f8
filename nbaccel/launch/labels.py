"""How a rank is named in output and errors: ``rank 5``, or ``rank 5 @ node2`` across hosts.

Each :class:`~nbaccel.launch.group.WorkerGroup` owns the :class:`RankLabels` of its ranks (from
its launcher's ``hosts_by_rank``) and hands them to its renderer, its output budget and the
reports of its calls, so that a pool on other hosts and a launch on this machine, in one kernel,
each name their own ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["LOCAL_LABELS", "RankLabels"]


@dataclass(frozen=True)
class RankLabels:
    """The names of one worker group's ranks: rank -> host, empty for ranks on this machine."""

    hosts: Mapping[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hosts", MappingProxyType(dict(self.hosts)))

    def label(self, rank: int) -> str:
        """``rank 5 @ node2`` when rank 5 runs on another host, else ``rank 5``."""
        host = self.hosts.get(rank)
        return f"rank {rank} @ {host}" if host else f"rank {rank}"


#: the labels of ranks on this machine (``rank 5``)
LOCAL_LABELS = RankLabels()
