"""Data parallelism (DDP across processes, nothing to wrap on one): ``DDPStrategy``.

DDP itself is torch's; this module only decides the constructor options and registers the
communication hook the user asked for, and answers ``no_sync`` / ``trigger_sync`` / unwrapping for
the DDP wrapper it adds. Accelerate's ``extract_model_from_parallel`` is re-exported here (its
import path), from :mod:`nbaccel.training.strategies.wrappers`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.nn.parallel import DistributedDataParallel

from nbaccel.training.config.kwargs_handlers import DistributedDataParallelKwargs
from nbaccel.training.strategies.base import Strategy
from nbaccel.training.strategies.wrappers import extract_model_from_parallel

__all__ = [
    "DDPStrategy",
    "extract_model_from_parallel",
    "wrap_ddp",
]


class DDPStrategy(Strategy):
    """Every process holds the whole model; DDP averages gradients across processes.

    On one process (``DistributedType.NO``) the model is not wrapped: the base behaviour.
    """

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.num_processes <= 1:
            return model
        return wrap_ddp(model, self.device, self.ddp_kwargs)

    @property
    def joins_uneven_inputs(self) -> bool:
        return self.num_processes > 1

    def unwrap_parallel(self, model: torch.nn.Module) -> torch.nn.Module:
        while isinstance(model, torch.nn.DataParallel | DistributedDataParallel):
            model = model.module
        return model

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        inner = getattr(model, "_orig_mod", model)
        if isinstance(inner, DistributedDataParallel):
            return inner.no_sync()
        return contextlib.nullcontext()

    def trigger_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        inner = getattr(model, "_orig_mod", model)
        if isinstance(inner, DistributedDataParallel):
            return _sync_next_backward(inner)
        return contextlib.nullcontext()


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


@contextlib.contextmanager
def _sync_next_backward(model: DistributedDataParallel) -> Iterator[None]:
    """Make the next backward of ``model`` synchronise, even after forwards under no_sync."""
    old = model.require_backward_grad_sync, model.require_forward_param_sync
    model.require_backward_grad_sync = True
    model.require_forward_param_sync = True
    # The forward ran with sync off, so the reducer was not told a backward is coming: tell it.
    model.reducer.prepare_for_backward([])
    try:
        yield
    finally:
        model.require_backward_grad_sync, model.require_forward_param_sync = old
