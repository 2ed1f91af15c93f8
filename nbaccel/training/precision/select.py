"""The precision policy of a run, chosen once from its ``mixed_precision``: autocast (and fp16
loss scaling) for ``no`` / ``fp16`` / ``bf16``, FP8 layers for ``fp8``."""

from __future__ import annotations

from typing import Any

from nbaccel.training.config.kwargs_handlers import AutocastKwargs, GradScalerKwargs
from nbaccel.training.precision.policy import PrecisionPolicy

__all__ = ["select_precision"]


def select_precision(
    mode: str,
    device_type: str,
    handlers: dict[type, Any],
    engine: str | None = None,
    plugin_fp8: bool = False,
) -> PrecisionPolicy:
    """The policy for ``mode`` on ``device_type`` with the accelerator's kwargs handlers.

    FP8 is asked for in any of Accelerate's ways: ``mode == "fp8"``, an FP8 recipe handler
    (``AORecipeKwargs`` / ``TERecipeKwargs``), or an FSDP plugin set to ``"fp8"``
    (``plugin_fp8``). Asked for, it is applied (FP8 layers, checked against the hardware here)
    or refused with the fix; never dropped. Without ``mode == "fp8"``, as in Accelerate, only
    the sharding engines turn it on (``engine``: ``"FSDP"``), and the rest of the model keeps
    ``mode``'s precision (FSDP's own policy gathers parameters in bf16)."""
    from nbaccel.training.precision.fp8.policy import Fp8Policy, fp8_recipe

    recipe = fp8_recipe(handlers)
    if mode == "fp8":
        return Fp8Policy(device_type, recipe, handlers.get(AutocastKwargs))
    if recipe is not None or plugin_fp8:
        asked = (
            f"{type(recipe).__name__} in kwargs_handlers"
            if recipe is not None
            else "FullyShardedDataParallelPlugin.set_mixed_precision('fp8')"
        )
        if engine == "DEEPSPEED":
            raise ValueError(
                f"FP8 was asked for ({asked}) but nbaccel does not run FP8 under DeepSpeed: "
                "remove it and train in bf16, or use FSDP2 (FullyShardedDataParallelPlugin) "
                "with AORecipeKwargs."
            )
        if engine != "FSDP":
            raise ValueError(
                f"FP8 was asked for ({asked}) without mixed_precision='fp8': pass "
                "Accelerator(mixed_precision='fp8', ...) (or nbaccel launch --mixed_precision "
                "fp8), as Accelerate requires outside FSDP and DeepSpeed."
            )
        return Fp8Policy(device_type, recipe, handlers.get(AutocastKwargs), autocast_mode=mode)
    return PrecisionPolicy(
        mode, device_type, handlers.get(AutocastKwargs), handlers.get(GradScalerKwargs)
    )
