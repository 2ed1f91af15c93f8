"""Looking through the wrappers ``prepare`` adds: unwrap a model, keep it from syncing.

The wrappers are DDP, FSDP2 (the module itself), ``torch.compile`` and nbaccel's mixed-precision
forward; these helpers decide by the model's own type, so they work on any prepared model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from nbaccel.training.precision import PrecisionPolicy

__all__ = ["extract_model_from_parallel", "no_sync_context", "trigger_sync_context"]


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


def no_sync_context(model: torch.nn.Module) -> Any:
    """A context in which backward passes of ``model`` do not synchronise gradients."""
    inner = model._orig_mod if hasattr(model, "_orig_mod") else model
    if isinstance(inner, DistributedDataParallel):
        return inner.no_sync()
    if hasattr(inner, "set_requires_gradient_sync"):  # FSDP2 modules
        return _fsdp2_no_sync(inner)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp2_no_sync(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@contextlib.contextmanager
def trigger_sync_context(model: torch.nn.Module) -> Iterator[None]:
    """Make the next backward of a DDP model synchronise, even after forwards under no_sync."""
    inner = model._orig_mod if hasattr(model, "_orig_mod") else model
    if not isinstance(inner, DistributedDataParallel):
        yield
        return
    old = inner.require_backward_grad_sync, inner.require_forward_param_sync
    inner.require_backward_grad_sync = True
    inner.require_forward_param_sync = True
    # The forward ran with sync off, so the reducer was not told a backward is coming: tell it.
    inner.reducer.prepare_for_backward([])
    try:
        yield
    finally:
        inner.require_backward_grad_sync, inner.require_forward_param_sync = old
