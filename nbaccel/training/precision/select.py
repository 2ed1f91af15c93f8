"""The precision policy of a run, chosen once from its ``mixed_precision``: autocast (and fp16
loss scaling) for ``no`` / ``fp16`` / ``bf16``, FP8 layers for ``fp8``."""

from __future__ import annotations

from typing import Any

from nbaccel.training.config.kwargs_handlers import AutocastKwargs, GradScalerKwargs
from nbaccel.training.precision.policy import PrecisionPolicy

__all__ = ["select_precision"]


def select_precision(mode: str, device_type: str, handlers: dict[type, Any]) -> PrecisionPolicy:
    """The policy for ``mode`` on ``device_type`` with the accelerator's kwargs handlers."""
    if mode == "fp8":
        from nbaccel.training.precision.fp8.policy import Fp8Policy, fp8_recipe

        return Fp8Policy(device_type, fp8_recipe(handlers), handlers.get(AutocastKwargs))
    return PrecisionPolicy(
        mode, device_type, handlers.get(AutocastKwargs), handlers.get(GradScalerKwargs)
    )
