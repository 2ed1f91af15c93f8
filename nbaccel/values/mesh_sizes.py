"""The sizes of a parallel mesh as launch options: checked against the world, and passed to the
ranks as the ``PARALLELISM_CONFIG_*`` variables that ``ParallelismConfig()`` reads (Accelerate's
names). Used by the launch request (``parallelism_config_*_size`` options) before any rank starts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["AXES", "check_mesh", "mesh_environment"]

#: the axes a launch can size, in the mesh's order
AXES = ("dp_replicate", "dp_shard", "tp", "cp")


def check_mesh(sizes: Mapping[str, int | None], world: int | None, cpu: bool) -> int | None:
    """The number of ranks the given ``sizes`` need (None when no size is given); raises
    ValueError naming the numbers when it is not ``world`` (None: not known yet), and for
    context parallel on CPU ranks."""
    given = {a: s for a, s in sizes.items() if s is not None}
    if not given:
        return None
    product = math.prod(given.values())
    if world is not None and product != world:
        shown = " x ".join(f"{a}_size={s}" for a, s in given.items())
        raise ValueError(
            f"The parallelism mesh {shown} = {product} ranks, but the launch has {world}: "
            f"launch {product} processes, or change the sizes so their product is {world}."
        )
    if given.get("cp", 1) > 1:
        import torch

        if cpu or not torch.cuda.is_available():
            raise ValueError(
                "parallelism_config_cp_size > 1 needs CUDA ranks: torch's context_parallel has "
                "no CPU kernel (SDPA's CPU flash attention has no sharding rule). Set "
                "parallelism_config_cp_size=1 here, or launch on GPUs."
            )
    return product


def mesh_environment(sizes: Mapping[str, int | None], cp_comm: str | None) -> dict[str, str]:
    """``PARALLELISM_CONFIG_<AXIS>_SIZE`` (and ``..._CP_COMM_STRATEGY``) for the ranks, with
    ``ACCELERATE_USE_PARALLELISM_CONFIG`` so that a plain ``Accelerator()`` uses them; empty
    when nothing was given."""
    env = {f"PARALLELISM_CONFIG_{a.upper()}_SIZE": str(s) for a, s in sizes.items() if s}
    if cp_comm is not None:
        env["PARALLELISM_CONFIG_CP_COMM_STRATEGY"] = cp_comm
    if env:
        env["ACCELERATE_USE_PARALLELISM_CONFIG"] = "true"
    return env
