"""torch-xla (TPU) runtime primitives: the device, the world, graph cuts, collectives, RNG.

torch-xla records operations lazily and compiles a graph when told to cut it (:func:`mark_step`).
Every import of ``torch_xla`` is inside a function: nbaccel imports and works without torch-xla
installed, and only a run on an XLA device reaches these functions.

:class:`XLACommunicator` is the :class:`~nbaccel.distributed.comm.Communicator` of XLA replicas
(``xm.all_gather``, ``xm.all_reduce``, ``xm.collective_broadcast``, ``xm.rendezvous`` for
picklable objects).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from nbaccel.distributed.comm import Communicator

__all__ = [
    "XLACommunicator",
    "all_gather",
    "all_reduce_sum",
    "broadcast_",
    "exchange_objects",
    "get_rng_state",
    "mark_step",
    "rendezvous",
    "set_rng_state",
    "synchronize_rng_state",
    "world",
    "xla_device",
]


def xla_device() -> torch.device:
    """This process's XLA device (a TPU core, or the CPU under ``PJRT_DEVICE=CPU``)."""
    import torch_xla

    if hasattr(torch_xla, "device"):  # torch-xla >= 2.7
        return torch_xla.device()
    import torch_xla.core.xla_model as xm

    return xm.xla_device()


def world() -> tuple[int, int, int, int]:
    """(world size, global ordinal, local ordinal, replicas per host) of this replica."""
    import torch_xla.runtime as xr

    size = xr.world_size()
    return size, xr.global_ordinal(), xr.local_ordinal(), max(size // max(xr.process_count(), 1), 1)


def mark_step() -> None:
    """Cut the lazily recorded graph here: compile (once) and run it."""
    import torch_xla

    if hasattr(torch_xla, "sync"):
        torch_xla.sync()
    else:  # torch-xla < 2.6
        import torch_xla.core.xla_model as xm

        xm.mark_step()


def rendezvous(tag: str) -> None:
    """Barrier across XLA replicas."""
    import torch_xla.core.xla_model as xm

    xm.rendezvous(tag)


# -- collectives ----------------------------------------------------------------------------
def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate every replica's ``tensor`` on dim 0 (scalars become one element each)."""
    import torch_xla.core.xla_model as xm

    return xm.all_gather(tensor.reshape(1) if tensor.ndim == 0 else tensor, dim=0)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over replicas (a new tensor)."""
    return all_reduce(tensor, "sum")


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """``tensor`` reduced over replicas by ``op`` (sum, max or min), as a new tensor."""
    import torch_xla.core.xla_model as xm

    xla_op = {"sum": xm.REDUCE_SUM, "max": xm.REDUCE_MAX, "min": xm.REDUCE_MIN}[op]
    return xm.all_reduce(xla_op, tensor)


def broadcast_(tensor: torch.Tensor, from_process: int = 0) -> torch.Tensor:
    """Overwrite ``tensor`` on every replica with replica ``from_process``'s values."""
    import torch_xla.core.xla_model as xm

    xm.collective_broadcast([tensor], root_ordinal=from_process)
    return tensor


def exchange_objects(obj: Any, tag: str = "nbaccel.objects") -> list[Any]:
    """Every replica's picklable ``obj``, indexed by replica (through ``xm.rendezvous``)."""
    import torch_xla.core.xla_model as xm

    payloads = xm.rendezvous(tag, pickle.dumps(obj))
    return [pickle.loads(p) for p in payloads]


# -- random numbers -------------------------------------------------------------------------
def get_rng_state() -> int:
    """The XLA device generator's seed state."""
    import torch_xla.core.xla_model as xm

    return int(xm.get_rng_state())


def set_rng_state(seed: int) -> None:
    """Set the XLA device generator's state."""
    import torch_xla.core.xla_model as xm

    xm.set_rng_state(seed)


def synchronize_rng_state(device: torch.device, is_main_process: bool) -> None:
    """Give every replica the main replica's XLA generator state."""
    import torch_xla.core.xla_model as xm

    seed = torch.tensor(xm.get_rng_state(), device=device)
    seed = xm.all_reduce("sum", seed if is_main_process else seed * 0)
    xm.set_rng_state(int(seed.item()))


class XLACommunicator(Communicator):
    """Collectives across torch-xla replicas.

    ``checks_shapes`` is False: tensors go straight to torch-xla's collectives, without the
    shape exchange (and ``pad_across_processes`` leaves them as they are).
    """

    name = "torch-xla"
    checks_shapes = False

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return all_gather(tensor)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(tensor)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return all_reduce(tensor, op)

    def broadcast_(self, tensor: torch.Tensor, from_process: int = 0) -> torch.Tensor:
        return broadcast_(tensor, from_process)

    def exchange_objects(self, obj: Any, tag: str = "nbaccel.objects") -> list[Any]:
        return exchange_objects(obj, tag)

    def broadcast_objects(self, objects: list[Any], from_process: int = 0) -> list[Any]:
        objects[:] = exchange_objects(list(objects), "nbaccel.bcast")[from_process]
        return objects

    def broadcast_host_tensor(self, tensor: torch.Tensor, from_process: int = 0) -> torch.Tensor:
        """Host generators are not synchronised across XLA replicas: ``tensor`` unchanged."""
        return tensor

    def device_rng_states(self) -> dict[str, Any]:
        return {"xla": get_rng_state()}
