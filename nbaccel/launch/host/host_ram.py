"""Host RAM a launch will need, estimated before any rank starts.

Tensors and modules in ``args`` that hold data are shared by the ranks (fork inheritance or
shared memory: one copy, copy-on-write). What each rank builds itself costs one copy per rank:
modules or tensors passed on the ``meta`` device (every rank materialises them), and, on torch-xla's
CPU device, each device's copy of the weights (its "device memory" is host RAM). When the total
exceeds the RAM available now, :func:`warn_if_short` says so before the ranks start, instead of
the kernel learning it from a rank killed by SIGKILL (the Colab/Kaggle TPU story: 8 processes,
8 copies of the model).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nbaccel.distributed.host_memory import available_memory

__all__ = ["HostRamEstimate", "HostRamWarning", "estimate_host_ram", "warn_if_short"]


class HostRamWarning(UserWarning):
    """A launch is likely to need more host RAM than is available."""


@dataclass(frozen=True)
class HostRamEstimate:
    """Bytes shared by every rank, bytes each rank materialises, ranks, and RAM available."""

    shared: int
    per_rank: int
    ranks: int
    available: int

    @property
    def total(self) -> int:
        return self.shared + self.ranks * self.per_rank

    @property
    def short(self) -> bool:
        return self.total > self.available


def _tensors(value: Any, seen: set[int], depth: int = 0) -> Iterator[torch.Tensor]:
    if id(value) in seen or depth > 8:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, nn.Module):
        yield from value.parameters()
        yield from value.buffers()
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item, seen, depth + 1)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            yield from _tensors(item, seen, depth + 1)


def _sizes(args: Any) -> tuple[int, int]:
    """(bytes of real tensors, one count per storage; bytes of meta tensors) in ``args``."""
    real = meta = 0
    storages: set[tuple[str, int]] = set()
    metas: set[int] = set()
    for tensor in _tensors(args, set()):
        if tensor.device.type == "meta":
            if id(tensor) not in metas:
                metas.add(id(tensor))
                meta += tensor.numel() * tensor.element_size()
            continue
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key not in storages:
            storages.add(key)
            real += storage.nbytes()
    return real, meta


def estimate_host_ram(
    args: Any, ranks: int, device_copies_in_host_ram: bool = False, available: int | None = None
) -> HostRamEstimate:
    """The host RAM ``ranks`` ranks of a launch with ``args`` need.

    ``device_copies_in_host_ram``: each rank's device copy of the weights is host memory
    (torch-xla's CPU device). ``available``: bytes free (default: :func:`available_memory`, cgroup
    limits included).
    """
    real, meta = _sizes(args)
    per_rank = meta + (real if device_copies_in_host_ram else 0)
    free = available_memory() if available is None else available
    return HostRamEstimate(shared=real, per_rank=per_rank, ranks=ranks, available=free)


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"


def warn_if_short(estimate: HostRamEstimate, fewer_devices_hint: str = "") -> bool:
    """Warn (:class:`HostRamWarning`) when ``estimate`` exceeds the RAM available; True if so."""
    if not estimate.short:
        return False
    hint = f", or use fewer devices ({fewer_devices_hint})" if fewer_devices_hint else ""
    warnings.warn(
        f"this launch may need about {_gib(estimate.total)} of host RAM: {estimate.ranks} ranks "
        f"each materialising {_gib(estimate.per_rank)} (tensors passed on the meta device, and "
        "device copies that live in host RAM) plus "
        f"{_gib(estimate.shared)} shared by all, but {_gib(estimate.available)} is available; "
        "ranks are killed (SIGKILL) when RAM runs out. Build the model once in the notebook and "
        f"pass it in args (shared copy-on-write, not copied per rank){hint}.",
        HostRamWarning,
        stacklevel=3,
    )
    return True
