"""Looking inside models: attribute paths, classes by name, PEFT wrappers, byte counts as text."""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

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


def convert_bytes(size: float) -> str:
    """``1536`` -> ``"1.5 KB"``: bytes as text, in 1024 steps, one decimal."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"
