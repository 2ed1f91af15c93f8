"""Accelerate's ``extract_model_from_parallel``: the user's module inside any wrappers.

It is handed any model (prepared by any accelerator, or wrapped by the user), so it decides by the
model's own type. nbaccel's Accelerator does not call it: it asks its strategy
(``Strategy.unwrap_model``, ``no_sync``), which knows the wrappers it added.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from nbaccel.training.precision import PrecisionPolicy

__all__ = ["extract_model_from_parallel"]


def extract_model_from_parallel(
    model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
) -> torch.nn.Module:
    """The user's module inside DDP / ``torch.compile`` wrappers.

    ``keep_fp32_wrapper=False`` also removes the mixed-precision forward nbaccel installed.
    ``keep_torch_compile=False`` returns the module underneath a compiled one.
    """
    compiled = None
    if hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
        compiled = model
        model = model._orig_mod
    while isinstance(model, DistributedDataParallel) or type(model).__name__ in (
        "DataParallel",
        "DistributedDataParallel",
    ):
        model = model.module
    if not keep_fp32_wrapper:
        PrecisionPolicy.unwrap_forward(model)
    if compiled is not None and keep_torch_compile:
        if compiled._orig_mod is not model:
            compiled._orig_mod = model
        return compiled
    return model
