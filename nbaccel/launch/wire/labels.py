"""How a rank is named in output and errors: ``rank 5``, or ``rank 5 @ node2`` across hosts.

Each :class:`~nbaccel.launch.driver.group.WorkerGroup` owns the :class:`RankLabels` of its ranks
(from its launcher's ``hosts_by_rank``) and hands them to its renderer, its output budget and the
reports of its calls, so that a pool on other hosts and a launch on this machine, in one kernel,
each name their own ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from string import Template
from types import MappingProxyType

__all__ = ["LINE_PREFIX_FIELDS", "LOCAL_LABELS", "RankLabels", "check_line_prefix"]

#: what a line prefix template (torch elastic's ``log_line_prefix_template``) may name
LINE_PREFIX_FIELDS = ("rank", "local_rank", "role_name")


def check_line_prefix(template: str | None) -> str | None:
    """``template`` when it names only :data:`LINE_PREFIX_FIELDS` (``"[${rank}] "``), else a
    ValueError naming the fix."""
    if template is None:
        return None
    try:
        Template(template).substitute(dict.fromkeys(LINE_PREFIX_FIELDS, ""))
    except (KeyError, ValueError) as exc:
        raise ValueError(
            f"log_line_prefix_template={template!r} cannot be filled ({exc}); it may use "
            f"{', '.join('${' + name + '}' for name in LINE_PREFIX_FIELDS)}."
        ) from None
    return template


@dataclass(frozen=True)
class RankLabels:
    """The names of one worker group's ranks: rank -> host, empty for ranks on this machine.

    ``line_prefix``: a template for the prefix of each output line instead of ``[rank N] ``
    (``${rank}``, ``${local_rank}``: the rank's index in its group, ``${role_name}``).
    """

    hosts: Mapping[int, str] = field(default_factory=dict)
    line_prefix: str | None = None
    local: Mapping[int, int] = field(default_factory=dict)  # rank -> index in its group

    def __post_init__(self) -> None:
        object.__setattr__(self, "hosts", MappingProxyType(dict(self.hosts)))
        object.__setattr__(self, "local", MappingProxyType(dict(self.local)))

    def prefix(self, rank: int) -> str:
        """What precedes each output line of ``rank``: ``[rank 5 @ node2] `` by default."""
        if self.line_prefix is None:
            return f"[{self.label(rank)}] "
        local = self.local.get(rank, rank)
        return Template(self.line_prefix).safe_substitute(
            rank=rank, local_rank=local, role_name="default"
        )

    def label(self, rank: int) -> str:
        """``rank 5 @ node2`` when rank 5 runs on another host, else ``rank 5``."""
        host = self.hosts.get(rank)
        return f"rank {rank} @ {host}" if host else f"rank {rank}"


#: the labels of ranks on this machine (``rank 5``)
LOCAL_LABELS = RankLabels()
