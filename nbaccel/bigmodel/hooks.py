"""Hooks around ``module.forward``: move inputs to a module's device, bring offloaded weights in
just before it runs (prefetched when possible) and send them away right after.

A hook replaces ``module.forward`` on the instance (the class is untouched) and keeps the original
in ``module._old_forward``; ``remove_hook_from_module`` restores it exactly.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from nbaccel.bigmodel.offload import Prefetcher, PrefixedDataset
from nbaccel.bigmodel.placement import _new_param, find_device, move_module_tensors, to_torch_device
from nbaccel.ops import send_to_device

__all__ = [
    "AlignDevicesHook",
    "CpuOffload",
    "ModelHook",
    "SequentialHook",
    "UserCpuOffloadHook",
    "add_hook_to_module",
    "align_module_device",
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
    "attach_execution_device_hook",
    "has_offloaded_params",
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


class AlignDevicesHook(ModelHook):
    """Run a module on ``execution_device``: inputs are moved there; with ``offload`` its weights
    live in ``weights_map`` (meta in the module) and are loaded for each forward, prefetched by a
    shared :class:`~nbaccel.bigmodel.offload.Prefetcher` when one is given. With
    ``io_same_device`` outputs go back to the device of the inputs."""

    def __init__(
        self,
        execution_device: int | str | torch.device | None = None,
        offload: bool = False,
        io_same_device: bool = False,
        weights_map: Mapping[str, torch.Tensor] | None = None,
        offload_buffers: bool = False,
        place_submodules: bool = False,
        skip_keys: str | list[str] | None = None,
        tied_params_map: dict | None = None,
        prefetcher: Prefetcher | None = None,
    ):
        self.execution_device = (
            None if execution_device is None else to_torch_device(execution_device)
        )
        self.offload = offload
        self.io_same_device = io_same_device
        self.weights_map = weights_map
        self.offload_buffers = offload_buffers
        self.place_submodules = place_submodules
        self.skip_keys = skip_keys
        self.tied_params_map = tied_params_map
        self.prefetcher = prefetcher
        self.input_device: torch.device | None = None
        self._slots: list[tuple[nn.Module, str, bool, str, torch.Tensor]] = []
        self._original_devices: dict[str, torch.device] = {}
        self._index = -1

    def __repr__(self) -> str:
        return (
            f"AlignDevicesHook(execution_device={self.execution_device}, offload={self.offload}, "
            f"io_same_device={self.io_same_device}, place_submodules={self.place_submodules})"
        )

    def _modules(self, module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        if self.place_submodules:
            yield from module.named_modules(remove_duplicate=False)
        else:
            yield "", module

    def init_hook(self, module: nn.Module) -> nn.Module:
        device = self.execution_device
        if not self.offload:
            if device is not None:
                # Meta tensors are left to an offloading hook appended after this one.
                move_module_tensors(module, device, recurse=self.place_submodules, skip_meta=True)
            return module
        if self.weights_map is None:
            self.weights_map = {
                name: t.detach().to("cpu") for name, t in self._direct_tensors(module, True)
            }
        self._slots = []
        missing: list[str] = []
        for prefix, sub in self._modules(module):
            pre = prefix + "." if prefix else ""
            stores = [(sub._parameters, True), (sub._buffers, False)]
            for store, is_param in stores:
                for leaf, tensor in list(store.items()):
                    if tensor is None:
                        continue
                    name = pre + leaf
                    offloadable = is_param or self.offload_buffers
                    if offloadable and name in self.weights_map:
                        self._original_devices[name] = tensor.device
                        meta = tensor if tensor.device.type == "meta" else tensor.to("meta")
                        if is_param and not isinstance(meta, nn.Parameter):
                            meta = _new_param(tensor, meta)
                        store[leaf] = meta
                        self._slots.append((sub, leaf, is_param, name, meta))
                    elif tensor.device.type == "meta":
                        missing.append(name)
                    elif device is not None and tensor.device != device:
                        store[leaf] = (
                            _new_param(tensor, tensor.detach().to(device))
                            if is_param
                            else tensor.to(device)
                        )
        if missing:
            raise ValueError(
                f"Cannot offload {type(module).__name__}: {missing} have no data (meta) and are "
                "not in the weights map. Load them from the checkpoint or add them to the map."
            )
        if self.prefetcher is not None and self._slots:
            self._index = self.prefetcher.register(self)
        return module

    def _direct_tensors(self, module: nn.Module, offloadable_only: bool):
        for prefix, sub in self._modules(module):
            pre = prefix + "." if prefix else ""
            for leaf, t in sub._parameters.items():
                if t is not None:
                    yield pre + leaf, t
            if self.offload_buffers or not offloadable_only:
                for leaf, t in sub._buffers.items():
                    if t is not None:
                        yield pre + leaf, t

    def prepare_weights(self, background: bool = False) -> tuple[dict, Any]:
        """Offloaded weights of this module on the execution device (zero-copy views on CPU).
        In the background on CUDA the copies run on a side stream; an event is returned."""
        device = self.execution_device or torch.device("cpu")
        advise = getattr(self.weights_map, "advise", None)
        cuda_bg = background and device.type == "cuda"
        stream = _side_stream(device) if cuda_bg else None
        out: dict[str, torch.Tensor] = {}
        done: dict[tuple, torch.Tensor] = {}
        for _, _, _, name, _ in self._slots:
            if name in out:
                continue
            src = self.weights_map[name]
            key = (src.device, src.data_ptr(), src.dtype, tuple(src.shape)) if src.numel() else None
            if key is not None and key in done:  # tied weights: one copy
                out[name] = done[key]
                continue
            if device.type == "cpu":
                if background and advise is not None:
                    advise(name, True)
                value = src if src.device.type == "cpu" else src.to("cpu")
            elif cuda_bg:
                with torch.cuda.stream(stream):
                    host = src if src.device.type != "cpu" or src.is_pinned() else src.pin_memory()
                    value = host.to(device, non_blocking=True)
            else:
                value = src.to(device)
            out[name] = value
            if key is not None:
                done[key] = value
        event = None
        if cuda_bg:
            event = torch.cuda.Event()
            event.record(stream)
        return out, event

    def load_weights(self, use_prefetcher: bool = True) -> None:
        """Put this module's offloaded weights in place (called before its forward)."""
        if self.prefetcher is not None and use_prefetcher and self._index >= 0:
            values, event = self.prefetcher.fetch(self._index)
        else:
            values, event = self.prepare_weights(False)
        if event is not None:
            current = torch.cuda.current_stream(self.execution_device)
            current.wait_event(event)
            for value in values.values():
                value.record_stream(current)
        for sub, leaf, is_param, name, meta in self._slots:
            value = values[name]
            if is_param:
                sub._parameters[leaf] = _new_param(meta, value)
            else:
                sub._buffers[leaf] = value

    def unload_weights(self) -> None:
        """Back to meta after the forward; disk pages are released from this process on CPU."""
        release = self.execution_device is None or self.execution_device.type == "cpu"
        advise = getattr(self.weights_map, "advise", None) if release else None
        for sub, leaf, is_param, name, meta in self._slots:
            if is_param:
                sub._parameters[leaf] = meta
            else:
                sub._buffers[leaf] = meta
            if advise is not None:
                advise(name, False)

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        if self.offload:
            self.load_weights()
        if self.execution_device is None:
            return args, kwargs
        return (
            send_to_device(args, self.execution_device),
            send_to_device(kwargs, self.execution_device, skip_keys=self.skip_keys),
        )

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.offload:
            self.unload_weights()
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device, skip_keys=self.skip_keys)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Offloaded weights come back into the module (onto their original device, or CPU)."""
        if self.offload:
            for sub, leaf, is_param, name, meta in self._slots:
                device = self._original_devices.get(name, torch.device("cpu"))
                device = torch.device("cpu") if device.type == "meta" else device
                value = self.weights_map[name].to(device)
                if is_param:
                    sub._parameters[leaf] = _new_param(meta, value)
                else:
                    sub._buffers[leaf] = value
            self._slots = []
        return module


_STREAMS: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device)
    return stream


def has_offloaded_params(module: nn.Module) -> bool:
    """True when ``module`` has a hook that offloads its weights."""
    hook = getattr(module, "_hf_hook", None)
    hooks = hook.hooks if isinstance(hook, SequentialHook) else (hook,)
    return any(isinstance(h, AlignDevicesHook) and h.offload for h in hooks)


def _offload_hook(module: nn.Module) -> AlignDevicesHook | None:
    hook = getattr(module, "_hf_hook", None)
    hooks = hook.hooks if isinstance(hook, SequentialHook) else (hook,)
    return next((h for h in hooks if isinstance(h, AlignDevicesHook) and h.offload), None)


@contextmanager
def align_module_device(
    module: nn.Module, execution_device: int | str | torch.device | None = None
) -> Iterator[None]:
    """Inside the block, ``module``'s own weights are materialised (offloaded ones loaded) on
    ``execution_device`` (or the hook's), and put back afterwards."""
    hook = _offload_hook(module)
    if hook is not None:
        saved = hook.execution_device
        if execution_device is not None:
            hook.execution_device = to_torch_device(execution_device)
        try:
            hook.load_weights(use_prefetcher=False)
            yield
        finally:
            hook.unload_weights()
            hook.execution_device = saved
        return
    if execution_device is None:
        yield
        return
    device = to_torch_device(execution_device)
    saved_params = dict(module._parameters)
    try:
        for leaf, param in saved_params.items():
            if param is not None:
                module._parameters[leaf] = _new_param(param, param.detach().to(device))
        yield
    finally:
        module._parameters.update(saved_params)


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
    is_preload = type(module).__name__ in preload
    if is_preload or module._parameters or module._buffers:
        prefix = f"{module_name}." if module_name else ""
        hook = AlignDevicesHook(
            execution_device=execution_device,
            offload=offload,
            weights_map=PrefixedDataset(weights_map, prefix) if weights_map is not None else None,
            offload_buffers=offload_buffers,
            place_submodules=is_preload,
            skip_keys=skip_keys,
            tied_params_map=tied_params_map,
            prefetcher=prefetcher,
        )
        add_hook_to_module(module, hook, append=True)
    if is_preload:
        return
    for name, child in module.named_children():
        attach_align_device_hook(
            child,
            execution_device,
            offload,
            weights_map,
            offload_buffers,
            f"{module_name}.{name}" if module_name else name,
            skip_keys,
            preload_module_classes,
            tied_params_map,
            prefetcher,
        )


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
    if module_name in execution_device:
        device = execution_device[module_name]
        if not offload.get(module_name, False):
            hook = AlignDevicesHook(
                device,
                io_same_device=module_name == "",
                place_submodules=True,
                skip_keys=skip_keys,
                tied_params_map=tied_params_map,
            )
            add_hook_to_module(module, hook)
            return
        add_hook_to_module(
            module, AlignDevicesHook(device, io_same_device=module_name == "", skip_keys=skip_keys)
        )
        attach_align_device_hook(
            module,
            device,
            True,
            weights_map,
            offload_buffers,
            module_name,
            skip_keys,
            preload_module_classes,
            tied_params_map,
            prefetcher,
        )
        return
    for name, child in module.named_children():
        attach_align_device_hook_on_blocks(
            child,
            execution_device,
            offload,
            weights_map,
            offload_buffers,
            f"{module_name}.{name}" if module_name else name,
            skip_keys,
            preload_module_classes,
            tied_params_map,
            prefetcher,
        )


class CpuOffload(ModelHook):
    """Keep the whole model on CPU and move it to ``execution_device`` when it is called; it stays
    there until ``offload`` (or the next model's forward, through ``prev_module_hook``)."""

    def __init__(
        self,
        execution_device: int | str | torch.device | None = None,
        prev_module_hook: UserCpuOffloadHook | None = None,
    ):
        if execution_device is None:
            execution_device = "cuda:0" if torch.cuda.is_available() else "cpu"
        self.execution_device = to_torch_device(execution_device)
        self.prev_module_hook = prev_module_hook
        self.on_execution_device = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        self.on_execution_device = False
        return module.to("cpu")

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if self.prev_module_hook is not None:
            self.prev_module_hook.offload()
        if not self.on_execution_device:
            module.to(self.execution_device)
            self.on_execution_device = True
        return send_to_device(args, self.execution_device), send_to_device(
            kwargs, self.execution_device
        )


class UserCpuOffloadHook:
    """What :func:`cpu_offload_with_hook` returns: ``offload()`` sends the model back to CPU,
    ``remove()`` removes the hook."""

    def __init__(self, model: nn.Module, hook: CpuOffload):
        self.model = model
        self.hook = hook

    def offload(self) -> None:
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        remove_hook_from_module(self.model)
