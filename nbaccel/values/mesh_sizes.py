"""The sizes of a parallel mesh as launch options, checked against the world before any rank
starts (the ``parallelism_config_*_size`` options; the ranks get them as Accelerate's
``PARALLELISM_CONFIG_*`` variables, :mod:`nbaccel.launch.options.accelerate_env`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["AXES", "check_mesh"]

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
