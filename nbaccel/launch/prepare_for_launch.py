"""``PrepareForLaunch``: a function made ready to run as one rank started by index.

``torch.multiprocessing.start_processes(fn, nprocs=N)`` calls ``fn(index, *args)`` in each child;
wrapping the function sets the variables ``torch.distributed`` reads for that rank first
(``LOCAL_RANK``, and ``RANK`` from ``NPROC``/``NODE_RANK``), as Accelerate's helper of the same
name does, or, with ``debug``, joins a gloo group through the file named by
``ACCELERATE_DEBUG_RDV_FILE``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from nbaccel.distributed.state import DistributedType

__all__ = ["PrepareForLaunch"]

_MULTI_PROCESS = {"MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_HPU"}


class PrepareForLaunch:
    """Call ``launcher(*args)`` as rank ``index`` (``PrepareForLaunch(fn, "MULTI_CPU")(i, ...)``).

    Args:
        launcher: the function each rank runs.
        distributed_type: a ``DistributedType`` (or its name); multi-process types get
            ``LOCAL_RANK``/``RANK`` set from the index.
        debug: form a gloo group of ``WORLD_SIZE`` ranks through a file store instead.
    """

    def __init__(
        self, launcher: Callable[..., Any], distributed_type: Any = "NO", debug: bool = False
    ) -> None:
        self.launcher = launcher
        self.distributed_type = DistributedType(
            getattr(distributed_type, "value", distributed_type)
        )
        self.debug = debug

    def __call__(self, index: int, *args: Any) -> Any:
        if self.debug:
            import torch.distributed as dist

            world_size = int(os.environ["WORLD_SIZE"])
            store = dist.FileStore(os.environ["ACCELERATE_DEBUG_RDV_FILE"], world_size)
            dist.init_process_group("gloo", rank=index, store=store, world_size=world_size)
        elif str(self.distributed_type.value) in _MULTI_PROCESS:
            os.environ["LOCAL_RANK"] = str(index)
            per_node = int(os.environ.get("NPROC", 1))
            os.environ["RANK"] = str(per_node * int(os.environ.get("NODE_RANK", 0)) + index)
        os.environ["FORK_LAUNCHED"] = "1"
        return self.launcher(*args)
