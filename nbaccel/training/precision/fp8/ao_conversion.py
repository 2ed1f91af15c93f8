"""torchao FP8: which linear layers to convert (all but the first and last, sizes multiples of
16, as Accelerate does for stability) and the in-place conversion to ``Float8Linear``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = [
    "convert_model_to_fp8_ao",
    "filter_first_and_last_linear_layers",
    "filter_linear_layers",
    "find_first_last_linear_layers",
    "has_ao_layers",
]


def find_first_last_linear_layers(model: nn.Module) -> tuple[str | None, str | None]:
    """Names of the first and last ``nn.Linear`` of ``model`` (registration order)."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return (names[0], names[-1]) if names else (None, None)


def filter_linear_layers(module: nn.Module, fqn: str, layers_to_filter: list[str]) -> bool:
    """True when ``module`` may become FP8: not one of ``layers_to_filter`` and, for a linear,
    both sizes multiples of 16 (what FP8 matmul kernels need)."""
    if isinstance(module, nn.Linear) and (module.in_features % 16 or module.out_features % 16):
        return False
    return fqn not in layers_to_filter


def filter_first_and_last_linear_layers(module: nn.Module, fqn: str) -> bool:
    """A filter for a whole model passed as ``module``: every linear but its first and last."""
    first, last = find_first_last_linear_layers(module)
    return filter_linear_layers(module, fqn, [n for n in (first, last) if n is not None])


def has_ao_layers(model: nn.Module) -> bool:
    """True when ``model`` holds a torchao ``Float8Linear``."""
    return any(
        type(m).__name__ == "Float8Linear" and type(m).__module__.startswith("torchao")
        for m in model.modules()
    )


def convert_model_to_fp8_ao(
    model: nn.Module,
    config: Any = None,
    module_filter_func: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Swap ``model``'s linears for torchao ``Float8Linear`` in place (all but the first and
    last by default) and return it. ``config``: a ``Float8LinearConfig``."""
    from torchao.float8 import convert_to_float8_training

    if module_filter_func is None:
        first, last = find_first_last_linear_layers(model)
        keep = [n for n in (first, last) if n is not None]
        module_filter_func = functools.partial(filter_linear_layers, layers_to_filter=keep)
    convert_to_float8_training(model, module_filter_fn=module_filter_func, config=config)
    return model
