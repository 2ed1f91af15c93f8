"""Putting tensors of a module on a device: one tensor by name, or a whole subtree keeping ties.

Moving parameters one module at a time would give each owner of a tied weight its own copy; the
helpers here move every distinct tensor once and hand the same new Parameter to all its owners.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from nbaccel.bigmodel.planning.device_map import normalize_device

__all__ = ["find_device", "move_module_tensors", "set_module_tensor_to_device", "to_torch_device"]


def to_torch_device(device: int | str | torch.device) -> torch.device:
    """A device-map value as ``torch.device`` (GPU ids need CUDA; 'disk' is not a torch device)."""
    norm = normalize_device(device)
    if norm == "disk":
        raise ValueError("'disk' is a storage location, not a device tensors can compute on.")
    if isinstance(norm, int):
        if not torch.cuda.is_available():
            raise ValueError(
                f"The device map uses GPU {norm} but CUDA is not available here: map those "
                "modules to 'cpu' or 'disk', or run on a machine with a GPU."
            )
        if norm >= torch.cuda.device_count():
            raise ValueError(
                f"The device map uses GPU {norm} but only {torch.cuda.device_count()} GPU(s) "
                "are visible."
            )
        return torch.device("cuda", norm)
    return torch.device(norm)


def _split(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner_name, _, leaf = name.rpartition(".")
    return (module.get_submodule(owner_name) if owner_name else module), leaf


def _new_param(old: nn.Parameter | None, value: torch.Tensor) -> nn.Parameter:
    requires_grad = old.requires_grad if old is not None else False
    requires_grad = requires_grad and (value.is_floating_point() or value.is_complex())
    cls = type(old) if isinstance(old, nn.Parameter) else nn.Parameter
    try:
        new = cls(value, requires_grad=requires_grad)
    except TypeError:
        new = nn.Parameter(value, requires_grad=requires_grad)
    if old is not None:
        new.__dict__.update(old.__dict__)
    rebind = new.__dict__.get("_nbaccel_rebind")  # a quantized placeholder completes its data
    if rebind is not None:
        rebind(new)
    return new


def set_module_tensor_to_device(
    module: nn.Module,
    tensor_name: str,
    device: int | str | torch.device,
    value: torch.Tensor | None = None,
    dtype: torch.dtype | str | None = None,
    fp16_statistics: torch.Tensor | None = None,
    tied_params_map: Mapping | None = None,
) -> None:
    """Put ``module``'s tensor ``tensor_name`` (dotted) on ``device``, optionally with new
    ``value`` and ``dtype``; parameters stay Parameters and keep ``requires_grad``."""
    owner, leaf = _split(module, tensor_name)
    is_param = leaf in owner._parameters
    if not is_param and leaf not in owner._buffers:
        raise ValueError(f"{type(module).__name__} has no parameter or buffer {tensor_name!r}.")
    old = owner._parameters[leaf] if is_param else owner._buffers[leaf]
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""))
    if value is None:
        if old is None:
            return
        if old.device.type == "meta" and str(device) != "meta":
            raise ValueError(
                f"{tensor_name!r} is on the meta device (no data): pass value= to set it."
            )
        value = old
    elif old is not None and old.shape != value.shape:
        # Accelerate's sentence exactly (the leaf's name): code written for it compares it
        raise ValueError(
            f'Trying to set a tensor of shape {value.shape} in "{leaf}" (which has shape '
            f"{old.shape}), this looks incorrect."
        )
    if dtype is not None and value.is_floating_point():
        value = value.to(dtype)
    elif (
        old is not None and value.is_floating_point() and old.is_floating_point() and dtype is None
    ):
        value = value.to(old.dtype)
    target = device if isinstance(device, torch.device) or device == "meta" else None
    if target is None:
        target = to_torch_device(device)
    value = value.detach().to(target)
    if is_param:
        owner._parameters[leaf] = _new_param(old, value)
    else:
        owner._buffers[leaf] = value


def move_module_tensors(
    module: nn.Module,
    device: torch.device,
    memo: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    include_buffers: bool = True,
    recurse: bool = True,
    prefix: str = "",
    skip_meta: bool = False,
) -> None:
    """Move every tensor under ``module`` to ``device``; a tensor shared by several owners (tied
    weights) is moved once and stays shared. Pass one ``memo`` across calls to keep ties that span
    several calls. Meta tensors raise an error naming them (or are skipped with ``skip_meta``)."""
    memo = {} if memo is None else memo
    on_meta: list[str] = []
    mods = (
        module.named_modules(prefix=prefix, remove_duplicate=False)
        if recurse
        else [(prefix, module)]
    )
    for mod_name, mod in mods:
        stores = [(mod._parameters, True)] + ([(mod._buffers, False)] if include_buffers else [])
        for store, is_param in stores:
            for leaf, tensor in store.items():
                if tensor is None:
                    continue
                hit = memo.get(id(tensor))
                if hit is not None:
                    store[leaf] = hit[1]
                    continue
                if tensor.device == device:
                    new = tensor
                elif tensor.device.type == "meta":
                    if skip_meta:
                        continue
                    on_meta.append(f"{mod_name}.{leaf}" if mod_name else leaf)
                    continue
                elif is_param:
                    new = _new_param(tensor, tensor.detach().to(device))
                else:
                    new = tensor.to(device)
                memo[id(tensor)] = (tensor, new)
                store[leaf] = new
    if on_meta:
        shown = ", ".join(repr(n) for n in on_meta[:20])
        more = f" and {len(on_meta) - 20} more" if len(on_meta) > 20 else ""
        raise ValueError(
            f"{len(on_meta)} tensor(s) have no data (still on the meta device): {shown}{more}. "
            "Load them first (load_checkpoint_in_model reports which keys the checkpoint lacks) "
            "or map their modules to 'disk' with an offload folder that holds them."
        )


def find_device(data: Any) -> torch.device | None:
    """Device of the first tensor found in nested lists / tuples / dicts (None if there is none)."""
    if isinstance(data, torch.Tensor):
        return data.device
    if isinstance(data, Mapping):
        data = list(data.values())
    if isinstance(data, list | tuple):
        for item in data:
            found = find_device(item)
            if found is not None:
                return found
    return None
