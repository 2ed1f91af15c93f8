"""Mixed precision as free functions: the autocast context and the loss scaler for the current
run, and a forward wrapper that returns fp32 outputs (what ``Accelerator.prepare`` uses)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from nbaccel.distributed.state import AcceleratorState, DistributedType, PartialState
from nbaccel.training.config.kwargs_handlers import AutocastKwargs
from nbaccel.training.precision.policy import convert_to_fp32

__all__ = ["ConvertOutputsToFp32", "get_grad_scaler", "get_mixed_precision_context_manager"]


class ConvertOutputsToFp32:
    """Wrap a forward so its floating outputs come back in fp32 (picklable, unlike a closure)."""

    def __init__(self, model_forward: Any) -> None:
        self.model_forward = model_forward
        self.__wrapped__ = model_forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(self.model_forward(*args, **kwargs))

    def __getstate__(self) -> dict[str, Any]:
        return {"model_forward": self.model_forward}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["model_forward"])


def _mixed_precision() -> str:
    return str(AcceleratorState._shared_state.get("mixed_precision", "no"))


def get_mixed_precision_context_manager(
    native_amp: bool = False, autocast_kwargs: AutocastKwargs | None = None
) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for the run's mixed precision on its device when ``native_amp``, else
    a null context."""
    if not native_amp:
        return contextlib.nullcontext()
    mode = _mixed_precision()
    if mode not in ("fp16", "bf16"):
        return contextlib.nullcontext()
    options = (autocast_kwargs or AutocastKwargs()).to_kwargs()
    device = PartialState().device.type if PartialState._shared_state else "cpu"
    dtype = torch.float16 if mode == "fp16" else torch.bfloat16
    return torch.autocast(device_type=device, dtype=dtype, **options)


def get_grad_scaler(distributed_type: DistributedType | None = None, **kwargs: Any) -> Any:
    """A ``torch.amp.GradScaler`` for the device of this run (FSDP2 uses the same scaler)."""
    device = PartialState().device.type if PartialState._shared_state else "cpu"
    if device == "xla":
        raise NotImplementedError("fp16 loss scaling on XLA is not supported; use bf16.")
    return torch.amp.GradScaler(device, **kwargs)
