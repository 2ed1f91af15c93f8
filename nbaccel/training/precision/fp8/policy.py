"""``mixed_precision="fp8"`` as a precision policy: the linears the recipe selects become FP8
layers (torchao ``Float8Linear`` or Transformer Engine's) when the model is prepared, before
DDP or FSDP2 wraps it; everything else runs under bf16 autocast, as in Accelerate. The hardware
is checked when the policy is built, before any model is touched."""

from __future__ import annotations

from typing import Any

from torch import nn

from nbaccel.distributed.host_info import fp8_hardware_problem
from nbaccel.training.config.kwargs_handlers import AutocastKwargs
from nbaccel.training.precision.fp8.recipes import AORecipeKwargs, TERecipeKwargs
from nbaccel.training.precision.policy import PrecisionPolicy

__all__ = ["Fp8Policy"]


class Fp8Policy(PrecisionPolicy):
    """FP8 matmuls in the selected linears, bf16 autocast around them, no loss scaling.

    Args:
        device_type: ``"cpu"`` or ``"cuda"`` (checked: FP8 kernels, or the recipe's emulation).
        recipe: an ``AORecipeKwargs`` (default) or ``TERecipeKwargs``.
        autocast_kwargs: options for the bf16 autocast.
        autocast_mode: the autocast around the FP8 layers (``"bf16"`` for
            ``mixed_precision="fp8"``; the run's own mode when FP8 comes from a recipe handler
            or an FSDP plugin alone, as in Accelerate).
    """

    def __init__(
        self,
        device_type: str,
        recipe: AORecipeKwargs | TERecipeKwargs | None = None,
        autocast_kwargs: AutocastKwargs | None = None,
        autocast_mode: str = "bf16",
    ) -> None:
        super().__init__(autocast_mode, device_type, autocast_kwargs)
        self.recipe = recipe if recipe is not None else AORecipeKwargs()
        self.backend = self.recipe.backend
        self.float8_config = (
            self.recipe.float8_config() if isinstance(self.recipe, AORecipeKwargs) else None
        )
        emulate = bool(getattr(self.float8_config, "emulate", False))
        problem = fp8_hardware_problem(device_type, emulate)
        if problem is not None:
            raise RuntimeError(problem)

    @property
    def name(self) -> str:
        return "fp8"

    def convert(self, model: nn.Module) -> nn.Module:
        """Swap the model's selected linears for FP8 layers, once."""
        if getattr(model, "_nbaccel_fp8", False):
            return model
        if self.backend == "AO":
            from nbaccel.training.precision.fp8.ao_conversion import convert_model_to_fp8_ao

            convert_model_to_fp8_ao(model, self.float8_config, self.recipe.module_filter_func)
        else:
            from nbaccel.training.precision.fp8.te_conversion import (
                apply_fp8_autowrap,
                convert_model,
            )

            convert_model(model)
            apply_fp8_autowrap(model, self.recipe)
        model._nbaccel_fp8 = True
        if not self.fp8_layer_count(model):
            raise ValueError(
                "FP8 training was asked for but no linear layer of this model can run in FP8 "
                "(torchao converts linears whose sizes are multiples of 16, except the first and "
                "last): pass AORecipeKwargs(module_filter_func=...) selecting layers, or train "
                "in bf16."
            )
        return model

    @staticmethod
    def fp8_layer_count(model: nn.Module) -> int:
        """How many of ``model``'s layers run their matmuls in FP8."""
        return sum(
            type(m).__name__ in ("Float8Linear", "Linear", "LayerNormLinear", "LayerNormMLP")
            and type(m).__module__.startswith(("torchao", "transformer_engine"))
            for m in model.modules()
        )

    def wrap_forward(self, model: nn.Module) -> None:
        """Convert ``model`` to FP8, then run its forward under bf16 autocast."""
        self.convert(model)
        super().wrap_forward(model)


def fp8_recipe(handlers: dict[type, Any]) -> AORecipeKwargs | TERecipeKwargs | None:
    """The one FP8 recipe among the accelerator's handlers (None: torchao's default)."""
    found = [h for k, h in handlers.items() if k in (AORecipeKwargs, TERecipeKwargs)]
    if len(found) > 1:
        raise ValueError("Pass one FP8 recipe: AORecipeKwargs or TERecipeKwargs, not both.")
    return found[0] if found else None
