"""Small building blocks of device-map planning that Accelerate exposes on their own: buffer
sizes, sizes of modules together with the tied weights they drag along, leaves, tie checks,
and the fallback search for one module that fits a memory limit."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from nbaccel.bigmodel.planning.memory_budgets import convert_file_size_to_int
from nbaccel.bigmodel.planning.module_sizes import compute_module_sizes

__all__ = [
    "check_device_same",
    "check_tied_parameters_in_config",
    "check_tied_parameters_on_same_device",
    "compute_module_total_buffer_size",
    "fallback_allocate",
    "get_module_leaves",
    "get_module_size_with_ties",
    "get_non_persistent_buffers",
]


def compute_module_total_buffer_size(
    model: nn.Module,
    dtype: str | torch.dtype | None = None,
    special_dtypes: Mapping[str, str | torch.dtype] | None = None,
) -> int:
    """Bytes of all the model's buffers (``dtype`` as the size of floating buffers if given)."""
    return compute_module_sizes(
        model, dtype=dtype, special_dtypes=special_dtypes, buffers_only=True
    ).get("", 0)


def get_module_size_with_ties(
    tied_params: list[str],
    module_size: int,
    module_sizes: Mapping[str, int],
    modules_to_treat: list[tuple[str, nn.Module]],
) -> tuple[int, list[str], list[nn.Module]]:
    """Size of a module plus the modules holding the other ends of its ties (``tied_params``,
    found among ``modules_to_treat``), without counting the tied tensors twice. Returns the
    size and the names and modules that must go with it."""
    names: list[str] = []
    modules: list[nn.Module] = []
    size = module_size
    for param in tied_params:
        owner = next(((n, m) for n, m in modules_to_treat if param.startswith(n + ".")), None)
        if owner is None:
            raise ValueError(f"Tied parameter {param!r} is under none of the modules to place.")
        names.append(owner[0])
        modules.append(owner[1])
        size += module_sizes[owner[0]] - module_sizes[param]
    return size, names, modules


def get_module_leaves(module_sizes: Mapping[str, int]) -> list[str]:
    """Names in ``module_sizes`` that have no child entry (the root ``""`` excluded)."""
    parents = {name.rsplit(".", 1)[0] for name in module_sizes if "." in name}
    return [name for name in module_sizes if name and name not in parents]


def get_non_persistent_buffers(
    module: nn.Module, recurse: bool = False, fqns: bool = False
) -> set[str]:
    """Names of buffers that are not saved in the state dict (``recurse``: of submodules too;
    ``fqns``: as dotted full names)."""
    found = set(module._non_persistent_buffers_set)
    if recurse:
        for name, sub in module.named_modules():
            prefix = f"{name}." if fqns and name else ""
            found |= {prefix + b for b in sub._non_persistent_buffers_set}
    return found


def check_device_same(first_device: torch.device, second_device: torch.device) -> bool:
    """True when two devices are the same (``cuda`` counts as ``cuda:0``)."""
    if first_device.type != second_device.type:
        return False

    def indexed(d: torch.device) -> torch.device:
        return torch.device(d.type, 0) if d.type != "cpu" and d.index is None else d

    return indexed(first_device) == indexed(second_device)


def check_tied_parameters_in_config(model: nn.Module) -> bool:
    """True when a transformers model's config declares tied weights (word embeddings,
    encoder/decoder) or one of its modules ties weights itself."""
    if "PreTrainedModel" not in [c.__name__ for c in inspect.getmro(type(model))]:
        return False
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    word = bool(
        text is not None
        and getattr(text, "tie_word_embeddings", False)
        and model.get_output_embeddings()
    )
    encoder_decoder = bool(
        getattr(config, "is_encoder_decoder", False)
        and getattr(config, "tie_encoder_decoder", False)
    )
    module_ties = any(hasattr(m, "_tie_weights") for m in model.modules())
    return word or encoder_decoder or module_ties


def _device_of(param: str, device_map: Mapping[str, Any]) -> Any:
    from nbaccel.bigmodel.planning.device_map import _lookup

    try:
        return _lookup(param, device_map)
    except KeyError:
        return None


def check_tied_parameters_on_same_device(
    tied_params: list[list[str]], device_map: Mapping[str, Any]
) -> None:
    """Warn for every tie group whose members the device map puts on different devices."""
    for group in tied_params:
        devices = {p: _device_of(p, device_map) for p in group}
        if len(set(map(str, devices.values()))) > 1:
            warnings.warn(
                f"Tied parameters are on different devices: {devices}. Put them on one device in "
                "your device map, or use device_map='auto'.",
                stacklevel=2,
            )


def _children_with_params(module: Any) -> list[tuple[str, Any]]:
    if isinstance(module, torch.Tensor):
        return []
    return list(module.named_parameters(recurse=False)) + list(module.named_children())


def fallback_allocate(
    modules: list[tuple[str, nn.Module]],
    module_sizes: dict[str, int],
    size_limit: int | str,
    no_split_module_classes: list[str] | None = None,
    tied_parameters: list[list[str]] | None = None,
) -> tuple[str | None, nn.Module | None, list[tuple[str, nn.Module]]]:
    """Find the first module (searching breadth-first into splittable ones) whose size, with its
    ties, fits ``size_limit``. Returns its name, the module, and ``modules`` with the ancestors
    of the found module expanded into their children and the found module removed; or
    ``(None, None, modules)`` when nothing fits."""
    try:
        limit = convert_file_size_to_int(size_limit)
    except ValueError:
        return None, None, modules
    no_split = set(no_split_module_classes or ())
    ties = tied_parameters or []
    queue = list(modules)
    found = None
    while queue:
        name, module = queue.pop(0)
        inside = name + "."
        partial = [
            g
            for g in ties
            if any(inside in p + "." for p in g) and not all(inside in p + "." for p in g)
        ]
        outside = [p for g in partial for p in g if inside not in p + "."]
        size, _, _ = get_module_size_with_ties(outside, module_sizes[name], module_sizes, queue)
        if size <= limit:
            found = name
            break
        children = _children_with_params(module)
        if children and type(module).__name__ not in no_split:
            queue = [(f"{name}.{n}", m) for n, m in children] + queue
    if found is None:
        return None, None, modules
    modules = list(modules)
    for i, ch in enumerate(found):
        if ch != ".":
            continue
        parent = found[:i]
        names = [n for n, _ in modules]
        if parent in names:
            at = names.index(parent)
            expanded = [(f"{parent}.{n}", m) for n, m in _children_with_params(modules[at][1])]
            modules = modules[:at] + expanded + modules[at + 1 :]
    at = [n for n, _ in modules].index(found)
    name, module = modules.pop(at)
    return name, module, modules
