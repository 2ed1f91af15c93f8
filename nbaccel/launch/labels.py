"""How a rank is named in output and errors: ``rank 5``, or ``rank 5 @ node2`` across hosts.

The worker group running a call says which host each of its ranks is on (:func:`use_hosts`,
empty for ranks on this machine); renderers and errors ask :func:`rank_label`.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["rank_label", "use_hosts"]

_hosts: dict[int, str] = {}


def use_hosts(hosts: Mapping[int, str]) -> None:
    """From now on, name ranks with these hosts (rank -> host); ``{}`` for a local launch."""
    global _hosts
    _hosts = dict(hosts)


def rank_label(rank: int) -> str:
    """``rank 5 @ node2`` when rank 5 runs on another host, else ``rank 5``."""
    host = _hosts.get(rank)
    return f"rank {rank} @ {host}" if host else f"rank {rank}"
