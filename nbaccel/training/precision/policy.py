"""Mixed precision on ``torch.amp``: which autocast context, whether to scale the loss.

One small policy object per accelerator. ``no`` does nothing; ``bf16`` autocasts to bfloat16 (on
CPU too) with no scaling; ``fp16`` autocasts to float16 and scales the loss with a
``torch.amp.GradScaler`` so small gradients do not underflow, skipping the optimizer step when
the scaled gradients overflow.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nbaccel.distributed.collectives import recursively_apply
from nbaccel.training.config.kwargs_handlers import AutocastKwargs, GradScalerKwargs

__all__ = ["PrecisionPolicy", "convert_outputs_to_fp32", "convert_to_fp32"]

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def convert_to_fp32(data: Any) -> Any:
    """Cast the half-precision floating tensors in a nested structure to float32."""

    def _cast(t: torch.Tensor) -> torch.Tensor:
        return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t

    return recursively_apply(_cast, data)


def convert_outputs_to_fp32(forward: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``forward`` so that its outputs come back in float32."""

    @functools.wraps(forward)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(forward(*args, **kwargs))

    return wrapper


class PrecisionPolicy:
    """Autocast and loss scaling for one mixed-precision mode on one device type.

    Args:
        mode: ``"no"``, ``"fp16"`` or ``"bf16"``.
        device_type: ``"cpu"``, ``"cuda"``, ``"xpu"``, ``"mps"`` or ``"xla"``.
        autocast_kwargs: options for ``torch.autocast``.
        scaler_kwargs: options for the fp16 ``GradScaler``.
    """

    def __init__(
        self,
        mode: str,
        device_type: str,
        autocast_kwargs: AutocastKwargs | None = None,
        scaler_kwargs: GradScalerKwargs | None = None,
    ) -> None:
        if mode not in ("no", "fp16", "bf16"):
            raise ValueError(f"Unknown mixed precision mode {mode!r}; use 'no', 'fp16' or 'bf16'.")
        self.mode = mode
        self.device_type = device_type
        self.autocast_handler = autocast_kwargs or AutocastKwargs()
        self.scaler = None
        if mode == "fp16" and device_type != "xla":
            options = (scaler_kwargs or GradScalerKwargs()).to_kwargs()
            self.scaler = torch.amp.GradScaler(device_type, **options)

    @property
    def enabled(self) -> bool:
        return self.mode != "no"

    @property
    def dtype(self) -> torch.dtype | None:
        return _DTYPES.get(self.mode)

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> Any:
        """The autocast context for this mode (a null context for ``no``)."""
        if not self.enabled:
            return contextlib.nullcontext()
        handler = autocast_handler or self.autocast_handler
        options = handler.to_kwargs()
        enabled = options.pop("enabled", True)
        device_type = self.device_type  # "xla" autocast is what reaches XLA tensors
        return torch.autocast(device_type=device_type, dtype=self.dtype, enabled=enabled, **options)

    def wrap_forward(self, model: torch.nn.Module) -> None:
        """Run ``model.forward`` under autocast, outputs in float32 (undo: ``unwrap_forward``)."""
        if not self.enabled or hasattr(model, "_nbaccel_original_forward"):
            return
        original = model.forward
        autocast = self.autocast

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with autocast():
                out = original(*args, **kwargs)
            return convert_to_fp32(out)

        model._nbaccel_original_forward = original
        model.forward = forward

    @staticmethod
    def unwrap_forward(model: torch.nn.Module) -> None:
        """Give ``model`` back the forward it had before :meth:`wrap_forward` (or before code
        written for Accelerate wrapped it and kept the original as ``_original_forward``)."""
        original = model.__dict__.pop("_nbaccel_original_forward", None)
        accelerate_style = model.__dict__.pop("_original_forward", None)
        original = original or accelerate_style
        if original is None:
            return
        if getattr(original, "__self__", None) is model and "forward" in model.__dict__:
            del model.__dict__["forward"]  # the bound class method comes back by itself
        else:
            model.forward = original

    def scale_and_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``backward`` on the (scaled, when fp16) loss."""
        if self.scaler is not None:
            self.scaler.scale(loss).backward(**kwargs)
        else:
            loss.backward(**kwargs)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Run a block in full precision even inside an autocast region."""
        if not self.enabled:
            yield
            return
        device_type = self.device_type  # "xla" autocast is what reaches XLA tensors
        with torch.autocast(device_type=device_type, enabled=False):
            yield
