"""Hooks around ``module.forward``: the :class:`ModelHook` protocol and how hooks are added to
and removed from a module.

A hook replaces ``module.forward`` on the instance (the class is untouched) and keeps the original
in ``module._old_forward``; ``remove_hook_from_module`` restores it exactly.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

__all__ = [
    "ModelHook",
    "SequentialHook",
    "add_hook_to_module",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
]


class ModelHook:
    """Base hook: override ``init_hook``, ``pre_forward``, ``post_forward``, ``detach_hook``.
    Set ``no_grad = True`` to run the wrapped forward under ``torch.no_grad()``."""

    no_grad = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        return module


class SequentialHook(ModelHook):
    """Several hooks applied in order (``post_forward`` in the same order)."""

    def __init__(self, *hooks: ModelHook):
        self.hooks = hooks

    def init_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.detach_hook(module)
        return module


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Wrap ``module.forward`` with ``hook``; with ``append`` an existing hook is kept and runs
    first (the two become a :class:`SequentialHook`), otherwise it is replaced."""
    if append and getattr(module, "_hf_hook", None) is not None:
        old = module._hf_hook
        remove_hook_from_module(module)
        hook = SequentialHook(old, hook)
    elif getattr(module, "_hf_hook", None) is not None:
        remove_hook_from_module(module)
    original = module.forward
    module._old_forward = original
    module = hook.init_hook(module)
    module._hf_hook = hook

    def forward(*args: Any, **kwargs: Any) -> Any:
        active = module._hf_hook
        args, kwargs = active.pre_forward(module, *args, **kwargs)
        if active.no_grad:
            with torch.no_grad():
                output = module._old_forward(*args, **kwargs)
        else:
            output = module._old_forward(*args, **kwargs)
        return active.post_forward(module, output)

    module.forward = functools.update_wrapper(forward, original)
    return module


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Detach the hook of ``module`` (and of every submodule with ``recurse``), restoring its
    original forward."""
    hook = module.__dict__.get("_hf_hook")
    if hook is not None:
        hook.detach_hook(module)
        del module._hf_hook
    if "_old_forward" in module.__dict__:
        original = module.__dict__.pop("_old_forward")
        bound_class_forward = getattr(original, "__func__", None) is type(module).forward
        if bound_class_forward and getattr(original, "__self__", None) is module:
            module.__dict__.pop("forward", None)
        else:
            module.forward = original
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse=True)
    return module


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Remove the hooks of every submodule of ``module`` (not of ``module`` itself)."""
    for child in module.children():
        remove_hook_from_module(child, recurse=True)
