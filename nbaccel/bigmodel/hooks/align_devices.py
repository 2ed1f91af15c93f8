"""The hook that runs a module on its execution device: inputs are moved there, and offloaded
weights are brought in just before the forward (prefetched when possible) and sent away right
after. :func:`align_module_device` materialises them outside a forward.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from nbaccel.bigmodel.hooks.model_hook import ModelHook, SequentialHook
from nbaccel.bigmodel.offload import Prefetcher
from nbaccel.bigmodel.placement import _new_param, find_device, move_module_tensors, to_torch_device
from nbaccel.distributed.collectives import send_to_device

__all__ = [
    "AlignDevicesHook",
    "align_module_device",
    "has_offloaded_params",
]


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


class _SideStreams:
    """One CUDA side stream per device, made on first use and kept for the process: the
    prefetches of every hook on that device share it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_device: dict[torch.device, Any] = {}

    def on(self, device: torch.device) -> Any:
        with self._lock:
            stream = self._by_device.get(device)
            if stream is None:
                stream = self._by_device[device] = torch.cuda.Stream(device)
            return stream


_side_streams = _SideStreams()


def _side_stream(device: torch.device) -> Any:
    return _side_streams.on(device)


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


def get_state_dict_offloaded_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of a dispatched model, offloaded (cpu/disk) weights read back, on the CPU.

    Each module's own weights are loaded one module at a time, so only the largest module has
    to fit in RAM at once. Tensors still on ``meta`` (never materialised) are left out with a
    warning naming them.
    """
    state: dict[str, torch.Tensor] = {}
    on_meta: list[str] = []
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        with align_module_device(module, "cpu"):
            own = dict(module._parameters)
            own.update(
                (k, v)
                for k, v in module._buffers.items()
                if k not in module._non_persistent_buffers_set
            )
            for leaf, tensor in own.items():
                if tensor is None:
                    continue
                if tensor.device.type == "meta":
                    on_meta.append(prefix + leaf)
                    continue
                state[prefix + leaf] = tensor.detach().to("cpu", copy=True)
    missing = [k for k in on_meta if k not in state]
    if missing:
        warnings.warn(
            f"Not saved, still on the meta device (never loaded): {', '.join(missing)}.",
            stacklevel=2,
        )
    return state
