"""How a model is wrapped for data parallelism, unwrapped again, and kept from syncing.

DDP itself is torch's; this module only decides the constructor options, registers the
communication hook the user asked for, and knows how to look through the wrappers nbaccel may
have added (DDP, ``torch.compile``, the mixed-precision forward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from nbaccel.training.kwargs_handlers import DistributedDataParallelKwargs

__all__ = [
    "extract_model_from_parallel",
    "no_sync_context",
    "trigger_sync_context",
    "wrap_ddp",
]


def wrap_ddp(
    model: torch.nn.Module,
    device: torch.device,
    ddp_handler: DistributedDataParallelKwargs | None = None,
) -> torch.nn.Module:
    """Wrap ``model`` in DDP (models without trainable parameters are returned as they are)."""
    if not any(p.requires_grad for p in model.parameters()):
        return model
    handler = ddp_handler or DistributedDataParallelKwargs()
    options = handler.ddp_kwargs()
    if device.type in ("cuda", "xpu"):
        options.setdefault("device_ids", [device.index or 0])
        options.setdefault("output_device", device.index or 0)
    wrapped = DistributedDataParallel(model, **options)
    _register_comm_hook(wrapped, handler)
    return wrapped


def _register_comm_hook(model: DistributedDataParallel, handler: DistributedDataParallelKwargs):
    hook = handler.comm_hook
    if hook == "no":
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        try:
            model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        except TypeError as err:  # torch allows bf16 all-reduce on NCCL/XCCL only
            raise ValueError(
                f"comm_hook='bf16' cannot run here ({err}); use comm_hook='fp16' on CPU (gloo)."
            ) from None
    else:
        options = {"matrix_approximation_rank": 1, **handler.comm_state_option}
        state = powerSGD_hook.PowerSGDState(process_group=None, **options)
        fn = (
            powerSGD_hook.powerSGD_hook
            if hook == "power_sgd"
            else powerSGD_hook.batched_powerSGD_hook
        )
        wrapper = {
            "fp16": default_hooks.fp16_compress_wrapper,
            "bf16": default_hooks.bf16_compress_wrapper,
        }.get(handler.comm_wrapper)
        model.register_comm_hook(state, wrapper(fn) if wrapper else fn)
        model.comm_hook_state = state  # kept for inspection (torch does not expose it)


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
        from nbaccel.training.precision import PrecisionPolicy

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
