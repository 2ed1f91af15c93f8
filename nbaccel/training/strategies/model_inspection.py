"""Looking inside models: attribute paths, classes by name, PEFT wrappers, byte counts as text."""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from nbaccel.values.byte_text import convert_bytes

__all__ = [
    "convert_bytes",
    "get_module_class_from_name",
    "is_peft_model",
    "recursive_getattr",
]


def recursive_getattr(obj: Any, attr: str) -> Any:
    """``getattr`` along a dotted path: ``recursive_getattr(model, "encoder.layer.0")``."""
    return functools.reduce(getattr, attr.split("."), obj)


def get_module_class_from_name(module: nn.Module, name: str) -> type | None:
    """The class called ``name`` among ``module`` and its submodules (None when absent)."""
    for sub in module.modules():
        if type(sub).__name__ == name:
            return type(sub)
    return None


def is_peft_model(model: Any) -> bool:
    """True for a ``peft.PeftModel`` (False when peft is not installed)."""
    from nbaccel.distributed.probes import is_peft_available

    if not is_peft_available():
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)
