"""Regional compilation: compile each block of a repeated stack (a ``ModuleList`` of one class,
as in every transformer) separately, so the compiler's cache is hit for blocks 2..N and the
cold start costs one block instead of the whole model. Plus small model inspections."""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch
from torch import nn

__all__ = [
    "compile_regions",
    "compile_regions_deepspeed",
    "compile_regions_fsdp2",
    "get_model_tp_size",
    "get_module_children_bottom_up",
    "has_compiled_regions",
    "has_repeated_blocks",
    "is_compiled_module",
    "is_repeated_blocks",
    "model_has_dtensor",
]


def is_compiled_module(module: nn.Module) -> bool:
    """True for the wrapper ``torch.compile`` returns."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def has_compiled_regions(module: nn.Module) -> bool:
    """True when some submodule (not the module itself) is a compiled wrapper."""
    return (
        any(is_compiled_module(m) for m in module.modules() if m is not module)
        if module._modules
        else False
    )


def is_repeated_blocks(module: nn.Module) -> bool:
    """True for a non-empty ``ModuleList`` whose items all share the first item's class."""
    return (
        isinstance(module, nn.ModuleList)
        and len(module) > 0
        and all(isinstance(m, type(module[0])) for m in module)
    )


def has_repeated_blocks(module: nn.Module) -> bool:
    """True when a repeated block stack is anywhere under ``module``."""
    return bool(module._modules) and any(is_repeated_blocks(m) for m in module.modules())


def _shallow_copy(module: nn.Module) -> nn.Module:
    copy = type(module).__new__(type(module))
    copy.__dict__.update(module.__dict__)
    for name, value in list(copy.__dict__.items()):  # methods bound to the original: rebind
        if getattr(value, "__self__", None) is module and hasattr(value, "__func__"):
            copy.__dict__[name] = MethodType(value.__func__, copy)
    copy._modules = {}
    return copy


def _compile(module: nn.Module, compile_kwargs: dict[str, Any]) -> nn.Module:
    if is_repeated_blocks(module):
        return nn.ModuleList(torch.compile(block, **compile_kwargs) for block in module)
    if has_repeated_blocks(module):
        copy = _shallow_copy(module)
        for name, child in module.named_children():
            copy.add_module(name, _compile(child, compile_kwargs))
        return copy
    return torch.compile(module, **compile_kwargs)


def compile_regions(module: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """A copy of ``module`` whose repeated blocks (and every other leaf region) are compiled one
    by one; ``_orig_mod`` points at the original, as on a ``torch.compile`` wrapper. The
    original module is left uncompiled."""
    compiled = _compile(module, compile_kwargs)
    compiled.__dict__.setdefault("_orig_mod", module)
    return compiled


def compile_regions_fsdp2(module: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """Regional compilation for an FSDP2-sharded model: each repeated block is compiled in
    place (``block.compile``) so the sharding hooks stay on the original modules."""
    if not has_repeated_blocks(module):
        module.compile(**compile_kwargs)
        return module
    for sub in module.modules():
        if is_repeated_blocks(sub):
            for block in sub:
                block.compile(**compile_kwargs)
    return module


def get_module_children_bottom_up(model: nn.Module, return_fqns: bool = False) -> list[Any]:
    """Every module under ``model``, children before parents, ``model`` last (with
    ``return_fqns``: ``(dotted name, module)`` pairs)."""
    order: list[tuple[str, nn.Module]] = []
    stack = [("", model)]
    while stack:
        name, current = stack.pop()
        order.append((name, current))
        stack.extend((f"{name}.{n}" if name else n, c) for n, c in current.named_children())
    order.reverse()
    return order if return_fqns else [m for _, m in order]


def model_has_dtensor(model: nn.Module) -> bool:
    """True when a parameter of ``model`` is a DTensor (FSDP2 or tensor parallel sharding)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def get_model_tp_size(model: nn.Module) -> int | None:
    """Tensor-parallel degree a model records (None: not TP-sharded; nbaccel itself does not
    shard with tensor parallelism). Looked up in ``model.tp_size`` (transformers < 5), then
    ``model.config.distributed_config`` (transformers >= 5; an object or a plain dict), then
    the ``tp`` axis of the model's device mesh."""
    size = getattr(model, "tp_size", None)
    if size is not None:
        return size
    distributed = getattr(getattr(model, "config", None), "distributed_config", None)
    size = (
        distributed.get("tp_size")
        if isinstance(distributed, dict)
        else getattr(distributed, "tp_size", None)
    )
    if size is not None:
        return size
    mesh = getattr(model, "_device_mesh", None) or getattr(model, "device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh["tp"].size() if "tp" in names else None


def compile_regions_deepspeed(module: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """Regional compilation for a module inside a DeepSpeed engine (``engine.module``): each
    repeated block is compiled in place, so ZeRO's parameter hooks stay on the original
    modules; a module without repeated blocks is compiled whole, in place."""
    return compile_regions_fsdp2(module, **compile_kwargs)
