"""Freeing cached device memory (CUDA, XPU, MPS caching allocators) after large objects go."""

from __future__ import annotations

import gc

import torch

__all__ = ["clear_device_cache"]


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Return the allocator's cached blocks to the device (optionally after a ``gc.collect``),
    so memory freed by Python shows as free to the next allocation and to other processes."""
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        xpu.empty_cache()
    mps = getattr(torch, "mps", None)
    if mps is not None and torch.backends.mps.is_available():
        mps.empty_cache()
