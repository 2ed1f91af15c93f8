"""Batches straight onto the XLA device: torch-xla's background loader around a prepared one.

``wrap_for_device(loader, device)`` wraps a prepared loader when ``device`` is an XLA device and
returns it unchanged otherwise, so :func:`nbaccel.data.prepare_data_loader` calls it for every
loader. torch-xla is imported only when a wrapped loader is iterated.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from nbaccel.distributed.xla_runtime import xla_device

__all__ = ["XLADeviceLoader", "wrap_for_device"]


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


def wrap_for_device(dataloader: Any, device: torch.device | None = None, **kwargs: Any) -> Any:
    """Wrap a (prepared) dataloader for the XLA device; other devices get it back unchanged.

    ``device=None`` means this process's XLA device.
    """
    if isinstance(dataloader, XLADeviceLoader):
        return dataloader
    if device is not None and torch.device(device).type != "xla":
        return dataloader
    return XLADeviceLoader(dataloader, device, **kwargs)
