"""Accelerate's ``extract_model_from_parallel``: the user's module inside any wrappers.

It is handed any model (prepared by any accelerator, or wrapped by the user), so it decides by the
model's own type. nbaccel's Accelerator does not call it: it asks its strategy
(``Strategy.unwrap_model``, ``no_sync``), which knows the wrappers it added.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from nbaccel.training.precision.policy import PrecisionPolicy

__all__ = ["extract_model_from_parallel"]


def extract_model_from_parallel(
    model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
) -> torch.nn.Module:
    """The user's module inside DDP / ``torch.compile`` wrappers.

    ``keep_fp32_wrapper=False`` also removes the mixed-precision forward nbaccel installed.
    ``keep_torch_compile=False`` returns the module underneath a compiled one.
    """
    return unwrap_with(model, _strip_data_parallel, keep_fp32_wrapper, keep_torch_compile)


def _strip_data_parallel(model: torch.nn.Module) -> torch.nn.Module:
    while isinstance(model, DistributedDataParallel) or type(model).__name__ in (
        "DataParallel",
        "DistributedDataParallel",
    ):
        model = model.module
    return model


def unwrap_with(
    model: torch.nn.Module,
    unwrap_parallel: Callable[[torch.nn.Module], torch.nn.Module],
    keep_fp32_wrapper: bool = True,
    keep_torch_compile: bool = True,
) -> torch.nn.Module:
    """The one way to peel a prepared model: ``torch.compile``'s wrapper (kept unless
    ``keep_torch_compile=False``, re-pointed at the unwrapped module), the data-parallel
    wrappers ``unwrap_parallel`` removes, and the mixed-precision forward
    (``keep_fp32_wrapper=False``)."""
    compiled = model if hasattr(model, "_orig_mod") else None
    inner = unwrap_parallel(model._orig_mod if compiled is not None else model)
    if not keep_fp32_wrapper:
        PrecisionPolicy.unwrap_forward(inner)
    if compiled is not None and keep_torch_compile:
        if compiled._orig_mod is not inner:
            compiled._orig_mod = inner
        return compiled
    return inner
