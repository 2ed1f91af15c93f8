"""The Ray cluster of a launch, and Ray itself: imported here only, when a launch asks for it.

The cluster is the one named by ``ray_address``, else ``RAY_ADDRESS``, else the one this
kernel's ``ray.init`` connected to. A kernel connected to one cluster is not moved to another
silently: that is an error naming both. An address is probed before Ray is asked to connect
(``reachable.py``): one where nothing listens, or nothing answers, is refused within seconds,
naming it, instead of after Ray's minutes of connection retries.
"""

from __future__ import annotations

import logging
import os
import socket
from types import ModuleType

from nbaccel.launch.remote.reachable import probe_grpc, split_address

__all__ = ["cluster_address", "connect", "import_ray", "probe_cluster"]

#: the port of a Ray Client server (``ray://host``) when the address names none
RAY_CLIENT_PORT = 10001
#: gRPC methods that only a Ray cluster's GCS, and a Ray Client server, answer (probed)
GCS_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"
RAY_CLIENT_METHOD = "/ray.rpc.RayletDriver/ClusterInfo"
#: ``ClusterInfoRequest(type=PING)`` serialized: what Ray's own client sends first
RAY_CLIENT_PING = b"\x08\x06"


def import_ray() -> ModuleType:
    """Ray, or an ImportError naming the extra that brings it."""
    try:
        import ray
    except ImportError:
        raise ImportError(
            "launcher='ray' needs Ray on this kernel (and the same version on the cluster): "
            "pip install nbaccel[ray]"
        ) from None
    return ray


def cluster_address(ray: ModuleType) -> str:
    """The GCS address of the cluster this kernel is connected to."""
    return str(ray.get_runtime_context().gcs_address)


def _same_address(ray: ModuleType, given: str, current: str) -> bool:
    """Whether ``given`` names the cluster at ``current`` (``127.0.0.1:6379`` and this
    machine's own address, with the same port, are one cluster)."""
    given = given.removeprefix("ray://")
    if given == current:
        return True
    host, _, port = given.rpartition(":")
    here, _, here_port = current.rpartition(":")
    if not host or port != here_port:
        return False
    try:
        ours = {
            here,
            ray.util.get_node_ip_address(),
            *socket.gethostbyname_ex(socket.gethostname())[2],
        }
        resolved = socket.gethostbyname(host)
    except OSError:
        return False
    return resolved in ours or (resolved.startswith("127.") and here in ours)


def probe_cluster(address: str) -> None:
    """Refuse, within seconds, a cluster address where no Ray answers (``auto``, ``local`` and
    schemes other than ``ray://`` are Ray's to resolve: not probed). ConnectionError
    (``Unreachable``) names the address and what did or did not answer there; ValueError an
    address that is not host:port."""
    if address in ("auto", "local") or ("://" in address and not address.startswith("ray://")):
        return  # Ray's to resolve (another scheme: a module Ray hands the address to)
    client = address.startswith("ray://")
    bare = address.removeprefix("ray://")
    what = "a Ray Client server (ray://)" if client else "a Ray cluster's GCS"
    try:
        host, port = split_address(bare, RAY_CLIENT_PORT if client else None)
    except ValueError:
        raise ValueError(
            f"ray_address {address!r} is not a cluster address: write 'head-host:6379' (the "
            "head's GCS port), 'ray://head-host:10001' (Ray Client) or 'auto' (on a node of "
            "the cluster)."
        ) from None
    if client:
        probe_grpc(host, port, what, RAY_CLIENT_METHOD, RAY_CLIENT_PING)
    else:
        probe_grpc(host, port, what, GCS_METHOD)


def connect(address: str | None) -> ModuleType:
    """Ray, connected to the launch's cluster (connecting now when the kernel is not yet)."""
    ray = import_ray()
    target = address or os.environ.get("RAY_ADDRESS") or None
    if ray.is_initialized():
        current = cluster_address(ray)
        if target and target != "auto" and not _same_address(ray, target, current):
            raise ValueError(
                f"this kernel is connected to the Ray cluster at {current}, and ray_address "
                f"(or RAY_ADDRESS) names {target}: call ray.shutdown() first to move to it, or "
                "leave ray_address out to use the cluster already connected."
            )
        return ray
    if not target:
        raise ValueError(
            "launcher='ray' needs a Ray cluster: pass ray_address='head-host:6379' ('auto' on a "
            "node of the cluster), set RAY_ADDRESS, or call ray.init(...) in the notebook first."
        )
    probe_cluster(target)
    try:
        # the ranks' output reaches the notebook through nbaccel's own channel: Ray's copy of
        # worker logs would print every line twice
        ray.init(address=target, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise RuntimeError(f"could not connect to the Ray cluster at {target}: {exc}") from None
    return ray
