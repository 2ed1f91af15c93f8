"""The torch-xla (TPU) pieces of a training step: device, optimizer step, graph cuts, loaders, bf16.

torch-xla records operations lazily and compiles a graph when told to cut it (``mark_step``).
nbaccel cuts after every optimizer step and lets torch-xla's ``MpDeviceLoader`` cut between
batches, so each training step is one compiled graph. Every import of ``torch_xla`` is inside a
function: nbaccel imports and works without torch-xla installed.

- ``optimizer_step(optimizer, closure)``: all-reduce (average) the gradients across replicas and
  step, through ``xm.optimizer_step``; then ``mark_step``. ``reduce_gradients(params)`` averages
  early (``clip_grad_norm_`` needs the global gradients) and the step then skips its own.
- ``wrap_dataloader(loader, device)``: batches land on the XLA device, prefetched in the
  background by ``MpDeviceLoader``; ``len``, ``set_epoch`` and the prepared loader's attributes
  still work.
- ``configure_bf16(mixed_precision, downcast_bf16)``: the ``XLA_USE_BF16`` /
  ``XLA_DOWNCAST_BF16`` switches (honoured by torch-xla < 2.6; newer releases dropped them, so
  nbaccel's bf16 there is ``torch.autocast("xla", dtype=torch.bfloat16)``, see ``autocast``).
- ``all_gather`` / ``all_reduce_sum`` / ``broadcast_`` / ``exchange_objects``: the collectives
  ``nbaccel.distributed.collectives`` uses on XLA replicas (``xm.all_gather``, ``xm.all_reduce``,
  ``xm.collective_broadcast``, ``xm.rendezvous`` for picklable objects).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "XLADeviceLoader",
    "all_gather",
    "all_reduce_sum",
    "autocast",
    "broadcast_",
    "configure_bf16",
    "exchange_objects",
    "mark_step",
    "optimizer_step",
    "reduce_gradients",
    "wrap_dataloader",
    "xla_device",
]


def xla_device() -> torch.device:
    """This process's XLA device (a TPU core, or the CPU under ``PJRT_DEVICE=CPU``)."""
    import torch_xla

    if hasattr(torch_xla, "device"):
        return torch_xla.device()
    import torch_xla.core.xla_model as xm

    return xm.xla_device()


def mark_step() -> None:
    """Cut the lazily recorded graph here: compile (once) and run it."""
    import torch_xla

    if hasattr(torch_xla, "sync"):
        torch_xla.sync()
    else:  # torch-xla < 2.6
        import torch_xla.core.xla_model as xm

        xm.mark_step()


# ids of parameters whose gradients reduce_gradients already averaged for the coming step
_REDUCED: set[int] = set()


def _world_size() -> int:
    import torch_xla.runtime as xr

    return xr.world_size()


def reduce_gradients(parameters: Any) -> None:
    """Average the gradients of ``parameters`` across replicas now (before clipping them).

    The next :func:`optimizer_step` then does not average them a second time.
    """
    import torch_xla.core.xla_model as xm

    grads = [p.grad for p in parameters if p.grad is not None]
    if grads and _world_size() > 1:
        xm.all_reduce(xm.REDUCE_SUM, grads, scale=1.0 / _world_size())
    _REDUCED.update(id(p) for p in parameters if p.grad is not None)


def optimizer_step(optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
    """Average gradients across XLA replicas, step ``optimizer``, then cut the graph."""
    import torch_xla.core.xla_model as xm

    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    already = bool(params) and all(id(p) in _REDUCED for p in params)
    _REDUCED.clear()
    if already:
        result = optimizer.step(closure) if closure is not None else optimizer.step()
    else:
        optimizer_args = {"closure": closure} if closure is not None else {}
        result = xm.optimizer_step(optimizer, optimizer_args=optimizer_args)
    mark_step()
    return result


def autocast(dtype: torch.dtype = torch.bfloat16, enabled: bool = True, **kwargs: Any) -> Any:
    """Autocast for XLA tensors (``torch.autocast("xla")``; CPU autocast leaves them alone)."""
    return torch.autocast("xla", dtype=dtype, enabled=enabled, **kwargs)


def configure_bf16(mixed_precision: str, downcast_bf16: bool = False) -> dict[str, str]:
    """Set torch-xla's bf16 environment for ``mixed_precision="bf16"``; returns what was set.

    ``downcast_bf16=True`` sets ``XLA_DOWNCAST_BF16`` (float32 -> bf16, float64 -> float32)
    instead of ``XLA_USE_BF16`` (both -> bf16). Must run before the first XLA tensor is made.
    """
    changes: dict[str, str] = {}
    if mixed_precision != "bf16":
        return changes
    name = "XLA_DOWNCAST_BF16" if downcast_bf16 else "XLA_USE_BF16"
    other = "XLA_USE_BF16" if downcast_bf16 else "XLA_DOWNCAST_BF16"
    os.environ[name] = changes[name] = "1"
    os.environ[other] = changes[other] = "0"
    return changes


class XLADeviceLoader:
    """A prepared dataloader whose batches arrive on the XLA device, prefetched by torch-xla.

    Iterating builds a ``torch_xla.distributed.parallel_loader.MpDeviceLoader`` over the wrapped
    loader (which keeps its sharding and its end-of-data bookkeeping); everything else
    (``len``, ``set_epoch``, ``batch_size``, ``dataset``, ...) is the wrapped loader's.
    """

    def __init__(self, dataloader: Any, device: torch.device | None = None, **kwargs: Any):
        self._loader = dataloader
        self._device = device
        self._kwargs = kwargs

    @property
    def device(self) -> torch.device:
        return self._device if self._device is not None else xla_device()

    @property
    def base_dataloader(self) -> Any:
        return self._loader

    def __iter__(self) -> Iterator[Any]:
        import torch_xla.distributed.parallel_loader as pl

        return iter(pl.MpDeviceLoader(self._loader, self.device, **self._kwargs))

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        if name == "_loader":
            raise AttributeError(name)
        return getattr(self._loader, name)

    def __repr__(self) -> str:
        return f"XLADeviceLoader({self._loader!r})"


def wrap_dataloader(dataloader: Any, device: torch.device | None = None, **kwargs: Any) -> Any:
    """Wrap a (prepared) dataloader for the XLA device; other devices get it back unchanged."""
    if isinstance(dataloader, XLADeviceLoader):
        return dataloader
    if device is not None and torch.device(device).type != "xla":
        return dataloader
    return XLADeviceLoader(dataloader, device, **kwargs)


# -- collectives on XLA replicas (nbaccel.distributed.collectives uses them on XLA) --
def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate every replica's ``tensor`` on dim 0 (scalars become one element each)."""
    import torch_xla.core.xla_model as xm

    return xm.all_gather(tensor.reshape(1) if tensor.ndim == 0 else tensor, dim=0)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over replicas (a new tensor)."""
    import torch_xla.core.xla_model as xm

    return xm.all_reduce(xm.REDUCE_SUM, tensor)


def broadcast_(tensor: torch.Tensor, from_process: int = 0) -> torch.Tensor:
    """Overwrite ``tensor`` on every replica with replica ``from_process``'s values."""
    import torch_xla.core.xla_model as xm

    xm.collective_broadcast([tensor], root_ordinal=from_process)
    return tensor


def exchange_objects(obj: Any, tag: str = "nbaccel.objects") -> list[Any]:
    """Every replica's picklable ``obj``, indexed by replica (through ``xm.rendezvous``)."""
    import pickle

    import torch_xla.core.xla_model as xm

    payloads = xm.rendezvous(tag, pickle.dumps(obj))
    return [pickle.loads(p) for p in payloads]
