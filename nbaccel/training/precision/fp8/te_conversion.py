"""Transformer Engine FP8: its layers in place of torch's and its autocast around the forward.
Everything here needs ``transformer_engine`` (NVIDIA GPUs of compute capability 8.9+)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["apply_fp8_autowrap", "contextual_fp8_autocast", "convert_model"]


def _te() -> Any:
    try:
        import transformer_engine.pytorch as te
    except ImportError as err:
        raise ImportError(
            "This needs NVIDIA Transformer Engine (pip install 'transformer_engine[pytorch]', "
            "NVIDIA GPUs of compute capability 8.9+); for FP8 with torchao use AORecipeKwargs()."
        ) from err
    return te


def convert_model(
    model: nn.Module,
    to_transformer_engine: bool = True,
    _convert_linear: bool = True,
    _convert_ln: bool = True,
) -> None:
    """Replace ``nn.Linear`` / ``nn.LayerNorm`` by Transformer Engine's layers (or back),
    keeping their weights."""
    te = _te()
    import torch

    for name, module in list(model.named_children()):
        if to_transformer_engine and _convert_linear and isinstance(module, nn.Linear):
            new = te.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                            params_dtype=module.weight.dtype)  # fmt: skip
            with torch.no_grad():
                new.weight.copy_(module.weight)
                if module.bias is not None:
                    new.bias.copy_(module.bias)
            setattr(model, name, new)
        elif to_transformer_engine and _convert_ln and isinstance(module, nn.LayerNorm):
            new = te.LayerNorm(module.normalized_shape[0], eps=module.eps,
                               params_dtype=module.weight.dtype)  # fmt: skip
            with torch.no_grad():
                new.weight.copy_(module.weight)
                new.bias.copy_(module.bias)
            setattr(model, name, new)
        elif not to_transformer_engine and _convert_linear and isinstance(module, te.Linear):
            new = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                            dtype=module.weight.dtype, device=module.weight.device)  # fmt: skip
            with torch.no_grad():
                new.weight.copy_(module.weight)
                if module.bias is not None:
                    new.bias.copy_(module.bias)
            setattr(model, name, new)
        else:
            convert_model(module, to_transformer_engine, _convert_linear, _convert_ln)


def contextual_fp8_autocast(
    model_forward: Callable, fp8_recipe: Any, use_during_eval: bool = False
) -> Callable:
    """Wrap a forward in ``te.fp8_autocast`` (off in eval mode unless ``use_during_eval``)."""
    te = _te()

    @functools.wraps(model_forward)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        enabled = use_during_eval or self.training
        ctx = te.fp8_autocast(enabled=enabled, fp8_recipe=fp8_recipe) if enabled else None
        with ctx or contextlib.nullcontext():
            return model_forward(*args, **kwargs)

    forward.__wrapped__ = model_forward
    return forward


def apply_fp8_autowrap(model: nn.Module, fp8_recipe_handler: Any) -> nn.Module:
    """Run ``model``'s forward under Transformer Engine's FP8 autocast with the recipe."""
    te = _te()
    from transformer_engine.common.recipe import DelayedScaling, Format

    handler = fp8_recipe_handler
    options = {k: v for k, v in handler.to_kwargs().items() if k != "use_autocast_during_eval"}
    fmt = options.pop("fp8_format", None)
    options.pop("use_mxfp8_block_scaling", None)
    recipe = DelayedScaling(fp8_format=getattr(Format, (fmt or "HYBRID").upper()), **options)
    wrapped = contextual_fp8_autocast(model.forward, recipe, bool(handler.use_autocast_during_eval))
    model.forward = wrapped.__get__(model)
    del te
    return model
