"""Spread a model over devices (``dispatch_model``) or offload it (``cpu_offload``,
``cpu_offload_with_hook``, ``disk_offload``).

Modules mapped to a GPU (or to the CPU when the CPU is also where the model runs) are moved there
once; modules mapped to ``"cpu"`` (with a GPU main device) or ``"disk"`` keep their weights in a
weights map and are loaded layer by layer, the next layer prefetched while the current one runs.
``device_map={"": "disk"}`` is valid: the whole model streams from disk onto the main device.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from nbaccel.bigmodel.hooks.align_devices import AlignDevicesHook
from nbaccel.bigmodel.hooks.attachment import (
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
)
from nbaccel.bigmodel.hooks.cpu_offload import CpuOffload, UserCpuOffloadHook
from nbaccel.bigmodel.hooks.model_hook import add_hook_to_module
from nbaccel.bigmodel.offload import (
    OffloadedWeightsLoader,
    Prefetcher,
    load_offload_index,
    offload_state_dict,
)
from nbaccel.bigmodel.placement import (
    move_module_tensors,
    set_module_tensor_to_device,
    to_torch_device,
)
from nbaccel.bigmodel.planning.device_map import get_device_map

__all__ = ["cpu_offload", "cpu_offload_with_hook", "disk_offload", "dispatch_model"]

OFFLOAD_INDEX_ATTR = "_nbaccel_offload_index"


def _main_device(device_map: Mapping[str, int | str], main_device) -> torch.device:
    if main_device is not None:
        return to_torch_device(main_device)
    for dev in device_map.values():
        if dev not in ("cpu", "disk"):
            return to_torch_device(dev)
    return torch.device("cpu")


def _resolve(model: nn.Module, name: str) -> nn.Module | None:
    """The module called ``name`` (None when ``name`` is a tensor)."""
    try:
        return model.get_submodule(name) if name else model
    except AttributeError:
        return None


def _state_of(module: nn.Module, prefix: str, offload_buffers: bool) -> dict[str, torch.Tensor]:
    pre = prefix + "." if prefix else ""
    out = {pre + n: p for n, p in module.named_parameters(remove_duplicate=False)}
    if offload_buffers:
        out.update({pre + n: b for n, b in module.named_buffers(remove_duplicate=False)})
    return out


def dispatch_model(
    model: nn.Module,
    device_map: Mapping[str, int | str | torch.device] | str,
    main_device: int | str | torch.device | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    offload_dir: str | os.PathLike | None = None,
    offload_index: Mapping[str, Mapping] | None = None,
    offload_buffers: bool = False,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
    prefetch: bool = True,
) -> nn.Module:
    """Place ``model`` according to ``device_map`` (module name -> GPU id, 'cpu' or 'disk') and
    add the hooks that make its forward work across devices; sets ``model.hf_device_map``.

    Disk weights come from ``offload_index`` / ``offload_dir`` (or from the in-place index left by
    :func:`load_checkpoint_in_model`); real tensors mapped to disk are written there once.
    ``prefetch=False`` turns off the background loading of the next offloaded layer.
    """
    device_map = get_device_map(model, device_map, offload_buffers=offload_buffers)
    main = _main_device(device_map, main_device)
    devices = set(device_map.values())
    offloaded = {"disk"} if main.type == "cpu" else {"cpu", "disk"}
    model.hf_device_map = dict(device_map)

    if not force_hooks and len(devices) == 1 and not devices & offloaded:
        move_module_tensors(model, to_torch_device(next(iter(devices))))
        return model

    weights_map = None
    if devices & offloaded:
        index = _known_disk_weights(model, offload_dir, offload_index)
        offloaded_map = {n: d for n, d in device_map.items() if d in offloaded}
        cpu_state, to_write = _offloaded_weights(
            model, offloaded_map, state_dict, index, offload_buffers, pin=main.type == "cuda"
        )
        _write_to_disk(to_write, offload_dir, index)
        weights_map = OffloadedWeightsLoader(
            state_dict=cpu_state, save_folder=offload_dir, index=index
        )
    _place_resident(model, device_map, offloaded, weights_map, main, offload_buffers)

    execution = {
        name: (main if dev in offloaded else to_torch_device(dev))
        for name, dev in device_map.items()
    }
    prefetcher = Prefetcher(enabled=prefetch) if weights_map is not None else None
    attach_align_device_hook_on_blocks(
        model,
        execution_device=execution,
        offload={name: dev in offloaded for name, dev in device_map.items()},
        weights_map=weights_map,
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        prefetcher=prefetcher,
    )
    if "" not in device_map:
        add_hook_to_module(
            model, AlignDevicesHook(io_same_device=True, skip_keys=skip_keys), append=True
        )
    model._nbaccel_prefetcher = prefetcher
    model._nbaccel_weights_map = weights_map
    return model


def _known_disk_weights(
    model: nn.Module, offload_dir: Any, offload_index: Mapping[str, Mapping] | None
) -> dict[str, Mapping]:
    """Weights already on disk: the offload folder's index, the in-place index
    ``load_checkpoint_in_model`` left on the model, then the caller's ``offload_index``."""
    index = dict(load_offload_index(offload_dir)) if offload_dir is not None else {}
    index.update(getattr(model, OFFLOAD_INDEX_ATTR, None) or {})
    index.update(offload_index or {})
    return index


def _offloaded_weights(
    model: nn.Module,
    offloaded_map: Mapping[str, int | str],
    state_dict: Mapping[str, torch.Tensor] | None,
    index: Mapping[str, Mapping],
    offload_buffers: bool,
    pin: bool,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The weights of offloaded blocks: (kept in CPU memory, still to be written to disk)."""
    cpu_state: dict[str, torch.Tensor] = {}
    to_write: dict[str, torch.Tensor] = {}
    for name, dev in offloaded_map.items():
        module = _resolve(model, name)
        if module is None:
            continue
        for tname, tensor in _state_of(module, name, offload_buffers).items():
            if state_dict is not None and tname in state_dict:
                tensor = state_dict[tname]
            if (dev == "disk" and tname in index) or tensor.device.type == "meta":
                continue  # on disk already; a meta tensor is reported by the hook, by name
            if dev == "disk":
                to_write[tname] = tensor
            else:
                tensor = tensor.detach().to("cpu")
                cpu_state[tname] = tensor.pin_memory() if pin else tensor
    return cpu_state, to_write


def _write_to_disk(
    to_write: Mapping[str, torch.Tensor], offload_dir: Any, index: dict[str, Mapping]
) -> None:
    """Write real tensors mapped to disk into ``offload_dir`` once, adding them to ``index``."""
    if not to_write:
        return
    if offload_dir is None:
        shown = ", ".join(list(to_write)[:5])
        raise ValueError(
            f"device_map puts weights on disk that are not offloaded yet ({shown}...): pass "
            "offload_dir= so they can be written there once, or load the model with "
            "load_checkpoint_in_model from a safetensors checkpoint (read in place)."
        )
    index.update(
        offload_state_dict(offload_dir, dict(to_write), file_name="dispatched.safetensors")
    )


def _place_resident(
    model: nn.Module,
    device_map: Mapping[str, int | str],
    offloaded: set[str],
    weights_map: Any,
    main: torch.device,
    offload_buffers: bool,
) -> None:
    """Move resident blocks once (one memo, so tied weights stay one tensor); buffers of
    offloaded blocks go to the execution device unless ``offload_buffers``."""
    memo: dict = {}
    for name, dev in device_map.items():
        obj = _resolve(model, name)
        is_offloaded = dev in offloaded
        if obj is None:  # a tensor-level entry ("block.weight": 0) stays resident
            value = (
                weights_map[name].clone()
                if weights_map is not None and name in weights_map
                else None
            )
            set_module_tensor_to_device(
                model, name, main if is_offloaded else to_torch_device(dev), value
            )
            continue
        if not is_offloaded:
            move_module_tensors(obj, to_torch_device(dev), memo, prefix=name)
        elif not offload_buffers:
            for sub in obj.modules():
                for leaf, buf in list(sub._buffers.items()):
                    if buf is not None and buf.device.type != "meta":
                        sub._buffers[leaf] = buf.to(main)


def cpu_offload(
    model: nn.Module,
    execution_device: int | str | torch.device | None = None,
    offload_buffers: bool = False,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    preload_module_classes: list[str] | None = None,
    prefetch: bool = True,
) -> nn.Module:
    """Keep one CPU copy of the weights and load each layer onto ``execution_device`` only for its
    forward (the next layer prefetched). Outputs come back on the inputs' device."""
    if execution_device is None:
        execution_device = next(iter(model.parameters())).device
    device = to_torch_device(execution_device)
    if state_dict is None:
        state_dict = {n: t.detach().to("cpu") for n, t in model.state_dict(keep_vars=True).items()}
        if device.type == "cuda":
            state_dict = {n: t.pin_memory() for n, t in state_dict.items()}
    return _offload_whole_model(
        model, device, state_dict, offload_buffers, preload_module_classes, prefetch
    )


def cpu_offload_with_hook(
    model: nn.Module,
    execution_device: int | str | torch.device | None = None,
    prev_module_hook: UserCpuOffloadHook | None = None,
) -> tuple[nn.Module, UserCpuOffloadHook]:
    """Move the whole model to ``execution_device`` when called and leave it there until
    ``hook.offload()`` (or until the next model in a ``prev_module_hook`` chain runs)."""
    hook = CpuOffload(execution_device=execution_device, prev_module_hook=prev_module_hook)
    add_hook_to_module(model, hook, append=True)
    return model, UserCpuOffloadHook(model, hook)


def disk_offload(
    model: nn.Module,
    offload_dir: str | os.PathLike,
    execution_device: int | str | torch.device | None = None,
    offload_buffers: bool = False,
    preload_module_classes: list[str] | None = None,
    prefetch: bool = True,
) -> nn.Module:
    """Write the weights once to ``offload_dir`` (safetensors, skipped when an index is already
    there) and stream each layer from the memory-mapped file during the forward."""
    if execution_device is None:
        execution_device = next(iter(model.parameters())).device
        if execution_device.type == "meta":
            execution_device = torch.device("cpu")
    device = to_torch_device(execution_device)
    index = load_offload_index(offload_dir)
    if not index:
        state = {
            n: t for n, t in model.state_dict(keep_vars=True).items() if t.device.type != "meta"
        }
        index = offload_state_dict(offload_dir, state)
    weights_map = OffloadedWeightsLoader(save_folder=offload_dir, index=index)
    return _offload_whole_model(
        model, device, weights_map, offload_buffers, preload_module_classes, prefetch
    )


def _offload_whole_model(
    model: nn.Module,
    device: torch.device,
    weights_map: Mapping[str, torch.Tensor],
    offload_buffers: bool,
    preload_module_classes: list[str] | None,
    prefetch: bool,
) -> nn.Module:
    """Hook every layer to load its weights from ``weights_map`` onto ``device`` for its forward
    (the next layer prefetched); outputs come back on the inputs' device."""
    prefetcher = Prefetcher(enabled=prefetch)
    attach_align_device_hook(
        model,
        execution_device=device,
        offload=True,
        weights_map=weights_map,
        offload_buffers=offload_buffers,
        preload_module_classes=preload_module_classes,
        prefetcher=prefetcher,
    )
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    model._nbaccel_prefetcher = prefetcher
    return model
