"""What a launch on a Ray cluster asks for, checked before anything starts (Ray not imported).

``launcher="ray"`` runs the ranks on a Ray cluster: the one named by ``ray_address``, else
``RAY_ADDRESS``, else the cluster this kernel is already connected to (``ray.init`` done by the
user). Each rank reserves ``ray_resources`` (``{"CPU": 1}`` by default; ``{"GPU": 1, "CPU": 4}``,
custom resources too) in one placement group, placed by ``ray_placement`` (``pack``: as few
nodes as possible, so a node's ranks share its NVLink; ``spread``: one rank per node where it
can; ``strict_pack``/``strict_spread``: Ray's strict forms). ``ray_keep_warm`` is how long a
``notebook_launcher`` call's ranks' nodes stay reserved, their agents warm, for the next call
(0: released at the launch's end; a ``%%distributed`` pool keeps them as long as it lives).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["PLACEMENTS", "RayOptions", "parse_resources", "ray_options"]

#: ``ray_placement`` -> Ray's placement group strategy
PLACEMENTS = {
    "pack": "PACK",
    "spread": "SPREAD",
    "strict_pack": "STRICT_PACK",
    "strict_spread": "STRICT_SPREAD",
}

#: how long a launch's reservation stays warm for the next launch, by default (seconds)
DEFAULT_KEEP_WARM = 300.0


@dataclass(frozen=True)
class RayOptions:
    """The cluster, what each rank reserves there, and how the ranks are placed."""

    address: str | None = None  # None: RAY_ADDRESS, else the cluster ray.init connected to
    resources: Mapping[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    placement: str = "pack"
    keep_warm: float = DEFAULT_KEEP_WARM

    def __hash__(self) -> int:
        return hash((self.address, tuple(sorted(self.resources.items())), self.placement))

    @property
    def gpus(self) -> float:
        """GPUs each rank reserves (0: CPU ranks, gloo)."""
        return float(self.resources.get("GPU", 0.0))

    @property
    def strategy(self) -> str:
        """Ray's placement group strategy."""
        return PLACEMENTS[self.placement]

    def describe(self) -> str:
        """``CPU=1, GPU=1 per rank, packed``."""
        each = ", ".join(f"{k}={_number(v)}" for k, v in sorted(self.resources.items()))
        return f"{each} per rank, {self.placement.replace('_', ' ')}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def parse_resources(value: Mapping[str, float] | str | None) -> dict[str, float]:
    """``{"GPU": 1}`` or ``"GPU=1,CPU=4,accelerator_type:A100=0.01"`` as numbers per resource;
    CPU defaults to 1 (a rank needs a core). Raises ValueError naming the bad entry."""
    if value is None:
        return {"CPU": 1.0}
    if isinstance(value, str):
        items = {}
        for entry in (e.strip() for e in value.split(",") if e.strip()):
            name, sep, amount = entry.partition("=")
            if not sep or not name.strip():
                raise ValueError(
                    f"ray_resources entry {entry!r} is not NAME=AMOUNT; write e.g. "
                    "'GPU=1,CPU=4' (per rank)."
                )
            items[name.strip()] = amount.strip()
        value = items
    if not isinstance(value, Mapping):
        raise ValueError(
            f"ray_resources must be a mapping such as {{'GPU': 1, 'CPU': 4}} (per rank), "
            f"got {value!r}."
        )
    resources: dict[str, float] = {}
    for name, amount in value.items():
        try:
            number = float(amount)
        except (TypeError, ValueError):
            number = math.nan
        if not isinstance(name, str) or not name or not math.isfinite(number) or number < 0:
            raise ValueError(
                f"ray_resources[{name!r}] must be a non-negative number (per rank), got {amount!r}."
            )
        if number:
            resources[name] = number
    gpus = resources.get("GPU", 0.0)
    if gpus > 1 and not gpus.is_integer():
        raise ValueError(
            f"ray_resources GPU={resources['GPU']}: a rank takes a fraction of one GPU or a "
            "whole number of them."
        )
    resources.setdefault("CPU", 1.0)
    return resources


def ray_options(
    address: str | None = None,
    resources: Mapping[str, float] | str | None = None,
    placement: str | None = None,
    keep_warm: float | None = None,
) -> RayOptions:
    """Validate a Ray launch's options; raises ValueError naming the problem and the fix."""
    if address is not None and (not isinstance(address, str) or not address.strip()):
        raise ValueError(
            f"ray_address must be the cluster's address ('auto', 'host:6379', 'ray://...'), "
            f"got {address!r}."
        )
    placement = "pack" if placement is None else str(placement).lower()
    if placement not in PLACEMENTS:
        raise ValueError(
            f"Unknown ray_placement {placement!r}; choose one of {', '.join(PLACEMENTS)}."
        )
    if keep_warm is None:
        keep_warm = DEFAULT_KEEP_WARM
    if isinstance(keep_warm, bool) or not isinstance(keep_warm, (int, float)) or keep_warm < 0:
        raise ValueError(
            f"ray_keep_warm must be a number of seconds >= 0 (0: release the nodes at the "
            f"launch's end), got {keep_warm!r}."
        )
    return RayOptions(
        address=address.strip() if address else None,
        resources=parse_resources(resources),
        placement=placement,
        keep_warm=float(keep_warm),
    )
