"""The torch-xla (TPU) training step: ``XLAStrategy``, the optimizer step, graph cuts, bf16.

torch-xla records operations lazily and compiles a graph when told to cut it (``mark_step``).
nbaccel cuts after every optimizer step and lets torch-xla's ``MpDeviceLoader`` cut between
batches, so each training step is one compiled graph. Every import of ``torch_xla`` is inside a
function: nbaccel imports and works without torch-xla installed.

- ``optimizer_step(optimizer, closure)``: all-reduce (average) the gradients across replicas and
  step, through ``xm.optimizer_step``; then ``mark_step``. ``reduce_gradients(params)`` averages
  early (``clip_grad_norm_`` needs the global gradients) and the step then skips its own.
- ``configure_bf16(mixed_precision, downcast_bf16)``: the ``XLA_USE_BF16`` /
  ``XLA_DOWNCAST_BF16`` switches (honoured by torch-xla < 2.6; newer releases dropped them, so
  nbaccel's bf16 there is ``torch.autocast("xla", dtype=torch.bfloat16)``, see ``autocast``).

The runtime primitives (device, collectives, RNG) live in :mod:`nbaccel.distributed.xla_runtime`
and the device loader in :mod:`nbaccel.data.xla_loader`; both are re-exported here.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from nbaccel.data.xla_loader import XLADeviceLoader
from nbaccel.data.xla_loader import wrap_for_device as wrap_dataloader
from nbaccel.distributed.xla_runtime import (
    all_gather,
    all_reduce_sum,
    broadcast_,
    exchange_objects,
    mark_step,
    xla_device,
)
from nbaccel.training.strategies.base import Strategy

__all__ = [
    "XLADeviceLoader",
    "XLAStrategy",
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


class _ReducedGradients:
    """The parameters whose gradients :func:`reduce_gradients` already averaged for the coming
    step (by id), taken by the step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: set[int] = set()

    def note(self, parameters: Any) -> None:
        with self._lock:
            self._ids.update(id(p) for p in parameters if p.grad is not None)

    def take(self, params: list[Any]) -> bool:
        """All of ``params`` were reduced already; forget every note (the step takes them)."""
        with self._lock:
            already = bool(params) and all(id(p) in self._ids for p in params)
            self._ids.clear()
            return already


_reduced = _ReducedGradients()


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
    _reduced.note(parameters)


def optimizer_step(optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
    """Average gradients across XLA replicas, step ``optimizer``, then cut the graph."""
    import torch_xla.core.xla_model as xm

    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    already = _reduced.take(params)
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


class XLAStrategy(Strategy):
    """Replicas on XLA devices: torch-xla averages gradients in the optimizer step.

    The model is placed on the XLA device (which gives it new Parameter objects) and not
    wrapped; loaders feed the device through torch-xla's background loader.
    """

    replaces_parameters = True

    def prepare_dataloader(self, dataloader: Any) -> Any:
        return wrap_dataloader(dataloader, self.device)

    def clip_grad_norm_(
        self, parameters: list[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        reduce_gradients(parameters)  # clip the global gradients, not this replica's
        return super().clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: list[torch.Tensor], clip_value: float) -> None:
        reduce_gradients(parameters)
        super().clip_grad_value_(parameters, clip_value)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
        return optimizer_step(optimizer, closure)
