"""Layerwise casting: keep the weights of compute layers in a small storage dtype (fp16, fp8)
and cast each layer up to the compute dtype only while its forward runs."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from nbaccel.bigmodel.hooks.model_hook import ModelHook, add_hook_to_module

__all__ = [
    "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING",
    "LayerwiseCastingHook",
    "attach_layerwise_casting_hooks",
]

# The layers whose weights are cast; norms, embeddings and the rest keep their dtype.
SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.Linear,
)


class LayerwiseCastingHook(ModelHook):
    """Stores the module in ``storage_dtype``; casts it to ``compute_dtype`` around forward."""

    def __init__(
        self, storage_dtype: torch.dtype, compute_dtype: torch.dtype, non_blocking: bool
    ) -> None:
        self.storage_dtype = storage_dtype
        self.compute_dtype = compute_dtype
        self.non_blocking = non_blocking

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        module.to(dtype=self.compute_dtype, non_blocking=self.non_blocking)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)
        return output


def attach_layerwise_casting_hooks(
    module: nn.Module,
    storage_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    skip_modules_pattern: str | tuple[str, ...] | None = None,
    skip_modules_classes: tuple[type[nn.Module], ...] | None = None,
    non_blocking: bool = False,
) -> None:
    """Attach a :class:`LayerwiseCastingHook` to every supported layer under ``module`` (or to
    ``module`` itself if it is one), skipping subtrees whose dotted name matches one of
    ``skip_modules_pattern`` (regular expressions) or whose class is in ``skip_modules_classes``."""
    patterns = (
        (skip_modules_pattern,) if isinstance(skip_modules_pattern, str) else skip_modules_pattern
    )
    stack = [("", module)]
    while stack:
        name, current = stack.pop()
        if skip_modules_classes is not None and isinstance(current, skip_modules_classes):
            continue
        if patterns is not None and any(re.search(p, name) for p in patterns):
            continue
        if isinstance(current, SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING):
            hook = LayerwiseCastingHook(storage_dtype, compute_dtype, non_blocking)
            add_hook_to_module(current, hook, append=True)
            continue
        stack.extend((f"{name}.{n}" if name else n, c) for n, c in current.named_children())
