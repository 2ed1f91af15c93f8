"""The communication backend of a run: how tensors and objects travel between ranks.

:class:`Communicator` is torch.distributed (gloo, NCCL, XCCL); the torch-xla replicas have their
own (:class:`nbaccel.distributed.xla_runtime.XLACommunicator`). ``PartialState`` picks one when it
sets up the world (``state.communicator``), so :mod:`nbaccel.distributed.collectives` and
:mod:`nbaccel.distributed.random` never ask which backend they are on. Every method is called
only when there is more than one process.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Communicator"]

# torch 2.13 renamed all_gather_into_tensor (and deprecated the old name).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Communicator:
    """Collectives over torch.distributed's process group.

    ``checks_shapes``: the collectives exchange every rank's tensor shapes first and raise a
    clear error on a mismatch (and ``pad_across_processes`` pads from them).
    """

    name = "torch.distributed"
    checks_shapes = True

    def __init__(self, device: torch.device, backend: str | None) -> None:
        self.device = device
        self.backend = backend

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated on dim 0 (a scalar counts as one element)."""
        tensor = tensor.detach().contiguous()  # gathered values carry no autograd history
        if tensor.ndim == 0:
            tensor = tensor.reshape(1)
        world = dist.get_world_size()
        out = torch.empty(
            (world * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device
        )
        _all_gather_single(out, tensor)
        return out

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of ``tensor`` over ranks (``tensor`` itself is overwritten and returned)."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``tensor`` reduced over ranks by ``op`` (sum, max or min), overwritten and returned."""
        dist.all_reduce(tensor, op=_REDUCE_OPS[op])
        return tensor

    def broadcast_(self, tensor: torch.Tensor, from_process: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with rank ``from_process``'s values."""
        dist.broadcast(tensor, src=from_process)
        return tensor

    def exchange_objects(self, obj: Any, tag: str = "nbaccel.objects") -> list[Any]:
        """Every rank's picklable ``obj``, indexed by rank."""
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, obj)
        return every

    def broadcast_objects(self, objects: list[Any], from_process: int = 0) -> list[Any]:
        """Fill the list ``objects`` in place with rank ``from_process``'s picklable items."""
        dist.broadcast_object_list(objects, src=from_process)
        return objects

    def broadcast_host_tensor(self, tensor: torch.Tensor, from_process: int = 0) -> torch.Tensor:
        """A CPU tensor (e.g. a generator state) from ``from_process``, through the device for
        NCCL (which has no CPU transport)."""
        if self.backend == "nccl":
            on_device = tensor.to(self.device)
            dist.broadcast(on_device, src=from_process)
            return on_device.cpu()
        tensor = tensor.clone()
        dist.broadcast(tensor, src=from_process)
        return tensor

    def device_rng_states(self) -> dict[str, Any]:
        """Generator states of the device runtime beyond torch's own (none here)."""
        return {}
