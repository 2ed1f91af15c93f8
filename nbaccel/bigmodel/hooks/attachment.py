"""Putting :class:`~nbaccel.bigmodel.hooks.align_devices.AlignDevicesHook` s on a module tree:
on every submodule that owns tensors, or per block of a device map.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from nbaccel.bigmodel.hooks.align_devices import AlignDevicesHook
from nbaccel.bigmodel.hooks.model_hook import add_hook_to_module
from nbaccel.bigmodel.offload import Prefetcher, PrefixedDataset

__all__ = [
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
    "attach_execution_device_hook",
]


def attach_execution_device_hook(
    module: nn.Module,
    execution_device: int | str | torch.device,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: dict | None = None,
) -> None:
    """Give every submodule with weights a hook that moves its inputs to ``execution_device``."""
    if (
        module._parameters
        or module._buffers
        or type(module).__name__ in (preload_module_classes or ())
    ):
        add_hook_to_module(
            module, AlignDevicesHook(execution_device, skip_keys=skip_keys), append=True
        )
        if type(module).__name__ in (preload_module_classes or ()):
            return
    for child in module.children():
        attach_execution_device_hook(child, execution_device, skip_keys, preload_module_classes)


def attach_align_device_hook(
    module: nn.Module,
    execution_device: int | str | torch.device | None = None,
    offload: bool = False,
    weights_map: Mapping[str, torch.Tensor] | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: dict | None = None,
    prefetcher: Prefetcher | None = None,
) -> None:
    """An :class:`AlignDevicesHook` on every submodule that owns tensors (each loads only its own
    weights, so one layer at a time is resident); ``preload_module_classes`` load as a whole."""
    preload = set(preload_module_classes or ())

    def visit(submodule: nn.Module, name: str) -> None:
        is_preload = type(submodule).__name__ in preload
        if is_preload or submodule._parameters or submodule._buffers:
            own = (
                None if weights_map is None else PrefixedDataset(weights_map, _child_name(name, ""))
            )
            hook = AlignDevicesHook(
                execution_device=execution_device,
                offload=offload,
                weights_map=own,
                offload_buffers=offload_buffers,
                place_submodules=is_preload,
                skip_keys=skip_keys,
                tied_params_map=tied_params_map,
                prefetcher=prefetcher,
            )
            add_hook_to_module(submodule, hook, append=True)
        if not is_preload:
            for child_name, child in submodule.named_children():
                visit(child, _child_name(name, child_name))

    visit(module, module_name)


def attach_align_device_hook_on_blocks(
    module: nn.Module,
    execution_device: Any = None,
    offload: Any = None,
    weights_map: Mapping[str, torch.Tensor] | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: dict | None = None,
    prefetcher: Prefetcher | None = None,
) -> None:
    """Hooks per block of a device map: ``execution_device`` and ``offload`` map block names to a
    device and to whether the block's weights are offloaded (plain values apply to ``module``)."""
    if not isinstance(execution_device, Mapping):
        execution_device = {module_name: execution_device}
    if not isinstance(offload, Mapping):
        offload = {module_name: bool(offload)}

    def visit(block: nn.Module, name: str) -> None:
        if name not in execution_device:
            for child_name, child in block.named_children():
                visit(child, _child_name(name, child_name))
            return
        device = execution_device[name]
        if not offload.get(name, False):
            hook = AlignDevicesHook(
                device,
                io_same_device=name == "",
                place_submodules=True,
                skip_keys=skip_keys,
                tied_params_map=tied_params_map,
            )
            add_hook_to_module(block, hook)
            return
        add_hook_to_module(
            block, AlignDevicesHook(device, io_same_device=name == "", skip_keys=skip_keys)
        )
        attach_align_device_hook(
            block,
            device,
            True,
            weights_map,
            offload_buffers,
            name,
            skip_keys,
            preload_module_classes,
            tied_params_map,
            prefetcher,
        )

    visit(module, module_name)


def _child_name(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child
