"""A launch's share of the Ray cluster: one placement group, one keeper actor per rank.

:func:`lease` places the ranks before anything of the launch starts: it checks the cluster can
hold them at all (refused at once with what the cluster has and what was asked), creates a
placement group with one bundle per rank (``pack``, ``spread``...), waits until Ray placed it
(refused after ``PLACE_TIMEOUT`` s with what is free now), starts one keeper per bundle, and
numbers the ranks node by node (a node's ranks are consecutive: its ``LOCAL_RANK`` 0..k-1, its
``NODE_RANK`` its position). The allocation's nodes then are the launch's hosts.

When the launch ends (:func:`give_back`) a pool's allocation, a broken one (a node lost) or one
asked with ``ray_keep_warm=0`` is removed at once (keepers killed, so their agents and ranks end;
the placement group removed); any other stays warm for ``ray_keep_warm`` seconds, and the next
launch of the same shape on the same cluster takes it as it is: its agents are up, torch
imported, so it costs a fork per rank. Every allocation is removed at the kernel's exit, and Ray
removes a job's actors and placement groups when the job (this kernel) ends in any case.
"""

from __future__ import annotations

import atexit
import contextlib
import secrets
import threading
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from nbaccel.launch.options.ray import RayOptions
from nbaccel.launch.remote.hosts import Host, HostLayout
from nbaccel.launch.remote.ray.connect import cluster_address, connect

__all__ = ["Allocation", "find", "give_back", "lease", "release_all"]

#: seconds to wait for Ray to place a placement group the cluster could hold
PLACE_TIMEOUT = 60.0
#: seconds to wait for the keepers to start and answer
START_TIMEOUT = 120.0


@dataclass
class Allocation:
    """One placement group and its keepers, in rank order."""

    id: str
    key: Hashable
    ray: Any
    group: Any  # the placement group
    keepers: list[Any]  # by rank
    layout: HostLayout
    gpus: list[list[str]]  # by node: the GPU ids of its ranks, in local-rank order
    pool: bool
    keep_warm: float
    leased: bool = True
    broken: str = ""
    released: bool = False
    timer: threading.Timer | None = field(default=None, repr=False)

    def node_keeper(self, node: int) -> Any:
        """The keeper that runs ``node``'s agent (its first rank's)."""
        first = sum(h.slots for h in self.layout.hosts[:node])
        return self.keepers[first]

    def alive(self, timeout: float = 10.0) -> bool:
        """Every keeper answers (a warm allocation whose node died is not taken again)."""
        refs = [k.info.remote() for k in self.keepers]
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if len(ready) < len(refs):
            return False
        try:
            self.ray.get(ready)
        except Exception:
            return False
        return True

    def release(self) -> None:
        """Kill the keepers (their agents and ranks end with them); remove the placement
        group."""
        with _kernel.lock:
            if self.released:
                return
            self.released = True
            _kernel.by_id.pop(self.id, None)
            if self.timer is not None:
                self.timer.cancel()
        if not self.ray.is_initialized():
            return  # the job ended: Ray removed its actors and placement groups itself
        for keeper in self.keepers:
            with contextlib.suppress(Exception):
                self.ray.kill(keeper, no_restart=True)
        with contextlib.suppress(Exception):
            self.ray.util.remove_placement_group(self.group)


class _KernelAllocations:
    """This kernel's allocations by id (warm or leased), with the lock every change takes."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.by_id: dict[str, Allocation] = {}


_kernel = _KernelAllocations()


def find(allocation_id: str | None) -> Allocation | None:
    """The allocation of this id, unless released."""
    with _kernel.lock:
        return _kernel.by_id.get(allocation_id or "")


def _key(address: str, count: int, options: RayOptions) -> Hashable:
    return (address, count, tuple(sorted(options.resources.items())), options.placement)


def lease(options: RayOptions, count: int, pool: bool) -> Allocation:
    """``count`` ranks placed on the cluster, each holding ``options.resources``: a warm
    allocation of the same shape when there is one, else a new one. Raises ValueError
    (the cluster cannot hold them) or RuntimeError (it could not place them now)."""
    ray = connect(options.address)
    key = _key(cluster_address(ray), count, options)
    with _kernel.lock:
        idle = [a for a in _kernel.by_id.values() if not a.leased and not a.released]
        match = next((a for a in idle if a.key == key and not a.broken), None)
        if match is not None:
            match.leased = True
            if match.timer is not None:
                match.timer.cancel()
                match.timer = None
    if match is not None:
        if match.alive():
            match.pool, match.keep_warm = pool, options.keep_warm
            return match
        match.release()
    _check_fits(ray, options, count)  # a refusal leaves the warm allocations as they are
    for other in idle:  # what this kernel holds idle makes room first
        if other is not match:
            other.release()
    return _place(ray, key, options, count, pool)


def _amounts(resources: dict[str, float]) -> str:
    def number(v: float) -> str:
        return str(int(v)) if float(v).is_integer() else f"{v:g}"

    return ", ".join(f"{k}={number(v)}" for k, v in sorted(resources.items()))


def _check_fits(ray: Any, options: RayOptions, count: int) -> None:
    """Refuse, before anything is created, a launch the cluster cannot hold at all."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    asked = {k: v * count for k, v in options.resources.items()}
    total: dict[str, float] = {}
    for node in nodes:
        for name, amount in node.get("Resources", {}).items():
            total[name] = total.get(name, 0.0) + float(amount)
    short = {k: v for k, v in asked.items() if total.get(k, 0.0) + 1e-9 < v}
    one_fits = any(
        all(
            float(n.get("Resources", {}).get(k, 0.0)) + 1e-9 >= v
            for k, v in options.resources.items()
        )
        for n in nodes
    )
    where = f"the Ray cluster at {cluster_address(ray)} ({len(nodes)} node(s))"
    has = _amounts({k: total.get(k, 0.0) for k in options.resources})
    if short:
        raise ValueError(
            f"{where} cannot hold {count} rank(s) of {_amounts(dict(options.resources))} each: "
            f"that is {_amounts(asked)}, and the cluster has {has} in all. Ask for fewer ranks "
            "or smaller ones (num_processes, ray_resources), or add nodes."
        )
    if not one_fits:
        raise ValueError(
            f"{where} has no node with {_amounts(dict(options.resources))} (one rank's share): "
            f"its nodes have {'; '.join(_amounts(dict(n.get('Resources', {}))) for n in nodes)}. "
            "Ask for less per rank (ray_resources)."
        )
    if options.placement == "strict_spread" and count > len(nodes):
        raise ValueError(
            f"ray_placement='strict_spread' puts each of the {count} ranks on its own node, and "
            f"{where} has {len(nodes)}: use 'spread' (as spread as it can) or fewer ranks."
        )


def _place(ray: Any, key: Hashable, options: RayOptions, count: int, pool: bool) -> Allocation:
    from ray.util.placement_group import placement_group, placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from nbaccel.launch.remote.ray.keeper import keeper_class

    bundles = [dict(options.resources) for _ in range(count)]
    group = placement_group(
        bundles, strategy=options.strategy, name=f"nbaccel-{secrets.token_hex(4)}"
    )
    keepers: list[Any] = []
    try:
        ready, _ = ray.wait([group.ready()], timeout=PLACE_TIMEOUT)
        if not ready:
            free = _amounts(
                {k: float(ray.available_resources().get(k, 0.0)) for k in options.resources}
            )
            raise RuntimeError(
                f"the Ray cluster at {cluster_address(ray)} could not place {count} rank(s) of "
                f"{_amounts(dict(options.resources))} ({options.placement}) within "
                f"{PLACE_TIMEOUT:.0f} s: {free} free now (other jobs hold the rest). Try again "
                "when they end, or ask for less."
            )
        node_of = placement_group_table(group)["bundles_to_node_id"]
        order = _rank_order(ray, node_of)
        actor = keeper_class()
        custom = {k: v for k, v in options.resources.items() if k not in ("CPU", "GPU")}
        for bundle in order:
            keepers.append(
                actor.options(
                    num_cpus=options.resources.get("CPU", 0.0),
                    num_gpus=options.resources.get("GPU", 0.0),
                    resources=custom,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        group, placement_group_bundle_index=bundle
                    ),
                    name=None,
                ).remote()
            )
        infos = ray.get([k.info.remote() for k in keepers], timeout=START_TIMEOUT)
        layout, gpus = _layout(ray, [info["node_id"] for info in infos], infos)
    except BaseException:
        for keeper in keepers:
            with contextlib.suppress(Exception):
                ray.kill(keeper, no_restart=True)
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(group)
        raise
    allocation = Allocation(
        id=secrets.token_hex(6),
        key=key,
        ray=ray,
        group=group,
        keepers=keepers,
        layout=layout,
        gpus=gpus,
        pool=pool,
        keep_warm=options.keep_warm,
    )
    with _kernel.lock:
        _kernel.by_id[allocation.id] = allocation
    return allocation


def _rank_order(ray: Any, node_of: dict[int, str]) -> list[int]:
    """The bundles in rank order: node by node, this kernel's node first (rank 0 where the
    notebook is, when it holds ranks), then the nodes in the order Ray listed the bundles."""
    here = ray.get_runtime_context().get_node_id()
    nodes: list[str] = []
    for bundle in sorted(node_of):
        if node_of[bundle] not in nodes:
            nodes.append(node_of[bundle])
    nodes.sort(key=lambda n: n != here)
    return [b for node in nodes for b in sorted(node_of) if node_of[b] == node]


def _layout(
    ray: Any, node_ids: list[str], infos: list[dict[str, Any]]
) -> tuple[HostLayout, list[list[str]]]:
    """The hosts of the ranks (consecutive ranks per node), named as Ray names the nodes (their
    address; with a short node id where several nodes share one, as on one machine)."""
    names = {
        n["NodeID"]: str(n.get("NodeName") or n.get("NodeManagerAddress")) for n in ray.nodes()
    }
    order: list[str] = []
    for node in node_ids:
        if node not in order:
            order.append(node)
    plain = [names.get(n, n[:8]) for n in order]
    labels = [
        name if plain.count(name) == 1 else f"{name}/{node[:6]}" for name, node in zip(plain, order)
    ]
    hosts = tuple(Host(label, node_ids.count(node)) for label, node in zip(labels, order))
    gpus = [
        [g for info in infos if info["node_id"] == node for g in info["gpus"]] for node in order
    ]
    return HostLayout(hosts), gpus


def give_back(allocation: Allocation, broken: str = "") -> None:
    """The launch using ``allocation`` ended: remove it, or keep it warm (see the module)."""
    if broken:
        allocation.broken = broken
    if allocation.broken or allocation.pool or allocation.keep_warm <= 0:
        allocation.release()
        return
    with _kernel.lock:
        if allocation.released:
            return
        allocation.leased = False
        timer = threading.Timer(allocation.keep_warm, _expire, args=(allocation,))
        timer.daemon = True
        allocation.timer = timer
    timer.start()


def _expire(allocation: Allocation) -> None:
    with _kernel.lock:
        if allocation.leased or allocation.released:
            return
    allocation.release()


def release_all() -> int:
    """Remove every allocation of this kernel (warm or not); how many there were. Runs at the
    kernel's exit."""
    with _kernel.lock:
        allocations = list(_kernel.by_id.values())
    for allocation in allocations:
        allocation.release()
    return len(allocations)


atexit.register(release_all)
