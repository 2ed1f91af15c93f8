"""``load_and_quantize_model``: fill a (usually empty) model from a checkpoint, quantizing its
linear layers tensor by tensor, and place it on a device map (CPU or GPU, with cpu/disk offload of
8-bit weights).

Order: every check first (config, backend installed and recent enough, checkpoint present,
device map a quantized model can follow), then the swap of the linears (bitsandbytes layers on
``meta``), then one pass over the checkpoint: each float weight of a quantized layer is cast to
``torch_dtype`` and quantized on the device that computes it (or quantized on the CPU and written
to the offload folder), every other tensor is cast and placed. Peak memory: the quantized model
plus one float tensor.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from nbaccel.bigmodel.dispatch import OFFLOAD_INDEX_ATTR, dispatch_model
from nbaccel.bigmodel.loading.checkpoint import CheckpointMismatchError, _expected_tensors
from nbaccel.bigmodel.loading.weight_files import offload_weight
from nbaccel.bigmodel.placement import _new_param, to_torch_device
from nbaccel.bigmodel.planning.device_map import _lookup
from nbaccel.bigmodel.quantization.bnb_layers import (
    get_keys_to_not_convert,
    is_quantized_layer,
    matches_module,
    quantize_weight,
    replace_with_bnb_layers,
)
from nbaccel.bigmodel.quantization.config import BnbQuantizationConfig, TorchAoConfig
from nbaccel.bigmodel.quantization.quantized_device_map import (
    check_quantized_placement,
    get_quantized_model_device_map,
    main_device,
)
from nbaccel.bigmodel.quantization.requirements import require_backend
from nbaccel.bigmodel.ties import find_tied_parameters
from nbaccel.storage.safetensors_file import SafetensorsFile
from nbaccel.storage.weights import checkpoint_files, open_weights

__all__ = ["load_and_quantize_model"]


def _declared_devices(device_map: Any) -> set[Any]:
    if isinstance(device_map, Mapping):
        return {d if isinstance(d, int) else str(d) for d in device_map.values()}
    if isinstance(device_map, int | torch.device) or device_map in ("cpu", "disk"):
        return {str(device_map) if not isinstance(device_map, int) else device_map}
    return {0} if torch.cuda.is_available() else {"cpu"}


def _tensors(
    weights_location: Any, in_memory: Mapping[str, torch.Tensor] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, float tensor) for every tensor of the checkpoint (or the model's own tensors)."""
    if in_memory is not None:
        yield from in_memory.items()
        return
    for path, keys in checkpoint_files(weights_location).items():
        handle = open_weights(path)
        for key in keys if keys is not None else list(handle.keys()):
            yield key, handle.read(key) if isinstance(handle, SafetensorsFile) else handle[key]
        del handle


class _QuantizedLoad:
    """One call: where each tensor goes, what it becomes, what was offloaded."""

    def __init__(self, model, config, device_map, quantized, keep_fp32, offload_folder) -> None:
        self.model, self.config, self.device_map = model, config, device_map
        self.quantized, self.keep_fp32 = quantized, keep_fp32
        self.offload_folder = offload_folder
        self.main = main_device(device_map)
        self.owners = _expected_tensors(model)
        self.ties = {n: g for g in find_tied_parameters(model) for n in g}
        self.disk_index: dict[str, dict] = {}
        self.cpu_state: dict[str, torch.Tensor] = {}
        self.placed: set[str] = set()
        self.unexpected: list[str] = []

    def _offloaded(self, device: Any) -> bool:
        return device == "disk" or (device == "cpu" and self.main != "cpu")

    def _float_dtype(self, owner: str) -> torch.dtype:
        return torch.float32 if matches_module(owner, self.keep_fp32) else self.config.torch_dtype

    def put(self, key: str, tensor: torch.Tensor) -> None:
        if key not in self.owners:
            self.unexpected.append(key)
            return
        if key in self.placed:
            return
        names = [n for n in self.ties.get(key, [key]) if n in self.owners]
        self.placed.update(names)
        owner, _, leaf = key.rpartition(".")
        device = _lookup(key, self.device_map)
        if owner in self.quantized and leaf == "weight":
            self._put_quantized(key, owner, tensor.to(self.config.torch_dtype), device)
            return
        if tensor.is_floating_point():
            tensor = tensor.to(self._float_dtype(owner))
        mod, leaf, is_param = self.owners[key]
        if self._offloaded(device) and is_param:  # buffers stay with the computing device
            if device == "disk":
                offload_weight(tensor, key, self.offload_folder, index=self.disk_index)
            else:
                self.cpu_state[key] = tensor.contiguous()
            value = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        else:
            target = self.main if device in ("disk", "cpu") else device
            value = tensor.to(to_torch_device(target))
        self._assign(names, value)

    def _assign(self, names: list[str], value: torch.Tensor) -> None:
        shared = None
        for name in names:
            mod, leaf, is_param = self.owners[name]
            if is_param:
                if shared is None:
                    shared = _new_param(mod._parameters[leaf], value)
                mod._parameters[leaf] = shared
            else:
                mod._buffers[leaf] = value

    def _put_quantized(self, key: str, owner: str, value: torch.Tensor, device: Any) -> None:
        from nbaccel.bigmodel.quantization.quantized_offload import (
            offloaded_int8_placeholder,
            quantize_and_offload_8bit,
        )

        module = self.model.get_submodule(owner)
        if self.config.backend == "torchao":
            from nbaccel.bigmodel.quantization.torchao_weights import quantize_linear_torchao

            module._parameters["weight"] = nn.Parameter(
                value.to(to_torch_device(device)), requires_grad=False
            )
            quantize_linear_torchao(module, self.config)
        elif device == "disk":
            quantize_and_offload_8bit(
                self.model, value, key, None, self.offload_folder, self.disk_index
            )
        elif self._offloaded(device):  # 8-bit weights kept in CPU memory, run on the GPU
            param = quantize_weight(module, value, torch.device("cpu"))
            self.cpu_state[key] = param.data
            module._parameters["weight"] = offloaded_int8_placeholder(param.shape, param.SCB)
        else:
            module._parameters["weight"] = quantize_weight(module, value, to_torch_device(device))

    def check_complete(self, weights_location: Any) -> None:
        missing = [
            n
            for n, (mod, leaf, is_param) in self.owners.items()
            if n not in self.placed
            and (mod._parameters[leaf] if is_param else mod._buffers[leaf]).device.type == "meta"
        ]
        if missing:
            shown = ", ".join(missing[:20]) + (
                f" and {len(missing) - 20} more" if len(missing) > 20 else ""
            )
            extra = (
                f"; unexpected keys: {', '.join(self.unexpected[:20])}" if self.unexpected else ""
            )
            raise CheckpointMismatchError(
                f"{weights_location!s} does not fill {type(self.model).__name__}: missing keys "
                f"{shown}{extra}. Use the checkpoint saved from this model."
            )


def load_and_quantize_model(
    model: nn.Module,
    bnb_quantization_config: BnbQuantizationConfig | TorchAoConfig,
    weights_location: str | os.PathLike | None = None,
    device_map: Mapping[str, int | str | torch.device] | str | None = None,
    no_split_module_classes: list[str] | None = None,
    max_memory: Mapping[int | str, int | str] | None = None,
    offload_folder: str | os.PathLike | None = None,
    offload_state_dict: bool = False,
) -> nn.Module:
    """Quantize ``model``'s linear layers (8-bit or 4-bit bitsandbytes, or torchao weight-only)
    while loading ``weights_location`` into it, on the CPU or GPUs following ``device_map``.

    ``model`` is usually built under ``init_empty_weights()``; a model with real weights is
    quantized from its own tensors when ``weights_location`` is None. 8-bit weights mapped to
    ``"disk"`` (or to ``"cpu"`` beside a GPU) are offloaded quantized and loaded back for each
    forward. Tensors are read one at a time, so ``offload_state_dict`` is accepted but unneeded.
    Returns the model, with ``is_loaded_in_8bit`` / ``is_loaded_in_4bit`` and ``hf_device_map``.
    """
    config = bnb_quantization_config
    if not isinstance(config, BnbQuantizationConfig | TorchAoConfig):
        raise TypeError(
            "bnb_quantization_config must be a BnbQuantizationConfig (bitsandbytes) or a "
            f"TorchAoConfig (torchao), not {type(config).__name__}."
        )
    on_meta = any(t.device.type == "meta" for t in model.state_dict(keep_vars=True).values())
    if weights_location is None and on_meta:
        raise ValueError(
            "The model has no weights (built on the meta device) and no weights_location was "
            "given: pass weights_location= (a checkpoint file or folder)."
        )
    if weights_location is not None:
        checkpoint_files(weights_location)  # a missing checkpoint is an error before any work
    require_backend(config, _declared_devices(device_map))
    if (
        isinstance(device_map, Mapping)
        and "disk" in _declared_devices(device_map)
        and offload_folder is None
    ):
        raise ValueError(
            "device_map sends modules to 'disk' but no offload_folder was given: pass "
            "offload_folder=... (the quantized weights are written there once)."
        )
    in_memory = None
    if weights_location is None:
        in_memory = {k: t.detach() for k, t in model.state_dict().items()}
    skip = config.skip_modules
    if skip is None:
        skip = get_keys_to_not_convert(model)
    keep_fp32 = list(
        config.keep_in_fp32_modules or getattr(model, "_keep_in_fp32_modules", None) or []
    )
    not_convert = list(skip) + keep_fp32
    if config.backend == "bitsandbytes":
        replace_with_bnb_layers(model, config, modules_to_not_convert=not_convert)
        quantized = {n for n, m in model.named_modules() if is_quantized_layer(m)}
    else:
        from nbaccel.bigmodel.quantization.torchao_weights import linears_to_quantize

        quantized = linears_to_quantize(model, not_convert)
    plan = get_quantized_model_device_map(
        model, config, device_map, max_memory, no_split_module_classes, quantized
    )
    check_quantized_placement(config, plan, quantized, offload_folder)
    load = _QuantizedLoad(model, config, plan, quantized, keep_fp32, offload_folder)
    for key, tensor in _tensors(weights_location, in_memory):
        load.put(key, tensor)
    del in_memory
    load.check_complete(weights_location or "the model's own tensors")
    _mark(model, config)
    offloads = set(plan.values()) - {load.main}
    if offloads:
        if load.disk_index:
            setattr(model, OFFLOAD_INDEX_ATTR, dict(load.disk_index))
        return dispatch_model(
            model,
            plan,
            state_dict=load.cpu_state or None,
            offload_dir=offload_folder,
            offload_index=load.disk_index or None,
        )
    model.hf_device_map = dict(plan)
    return model


def _mark(model: nn.Module, config: Any) -> None:
    """The flags transformers and Accelerate read on a quantized model."""
    model.is_loaded_in_8bit = config.bits == 8 and config.backend == "bitsandbytes"
    model.is_loaded_in_4bit = config.bits == 4 and config.backend == "bitsandbytes"
    model.is_quantized = True
    model.quantization_method = config.backend
    model._nbaccel_quantization_config = config
