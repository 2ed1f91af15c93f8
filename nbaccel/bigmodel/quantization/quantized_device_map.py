"""Device maps planned with the sizes a model will have once quantized: quantized linear weights
count at 1 byte (8-bit) or half a byte (4-bit) per weight, the other floating tensors at the
config's ``torch_dtype`` (float32 for ``keep_in_fp32_modules``). Then the placement rules of a
quantized model are checked before any weight is read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from nbaccel.bigmodel.planning.device_map import (
    DEVICE_MAP_STRINGS,
    get_device_map,
    infer_auto_device_map,
)
from nbaccel.bigmodel.planning.memory_budgets import get_balanced_memory, get_max_memory
from nbaccel.bigmodel.quantization.bnb_layers import is_quantized_layer, matches_module

__all__ = [
    "check_quantized_placement",
    "get_quantized_model_device_map",
    "main_device",
    "quantized_special_dtypes",
]


def quantized_special_dtypes(
    model: nn.Module, config: Any, quantized_modules: set[str] | None = None
) -> dict[str, Any]:
    """name -> the dtype each tensor of ``model`` will have after quantized loading."""
    keep_fp32 = list(config.keep_in_fp32_modules or [])
    quantized_modules = quantized_modules or set()
    out: dict[str, Any] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        owner, _, leaf = name.rpartition(".")
        if owner in quantized_modules and leaf == "weight":
            out[name] = config.target_dtype
        elif tensor.is_floating_point():
            out[name] = torch.float32 if matches_module(owner, keep_fp32) else config.torch_dtype
    return out


def main_device(device_map: Mapping[str, Any]) -> Any:
    """Where the model computes: its first GPU, else the CPU."""
    gpus = sorted(d for d in device_map.values() if isinstance(d, int))
    return gpus[0] if gpus else "cpu"


def get_quantized_model_device_map(
    model: nn.Module,
    bnb_quantization_config: Any,
    device_map: Mapping[str, Any] | str | None = None,
    max_memory: Mapping[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    quantized_modules: set[str] | None = None,
) -> dict[str, Any]:
    """The device map of a model about to be quantized: ``None`` puts it all on the current GPU
    (the CPU without one); ``"auto"``, ``"balanced"``, ``"balanced_low_0"``, ``"sequential"``
    plan with the quantized sizes; a dict is checked and normalised."""
    if device_map is None:
        return {"": torch.cuda.current_device() if torch.cuda.is_available() else "cpu"}
    if not (isinstance(device_map, str) and device_map in DEVICE_MAP_STRINGS):
        return dict(get_device_map(model, device_map))
    if quantized_modules is None:
        quantized_modules = {n for n, m in model.named_modules() if is_quantized_layer(m)}
    special = quantized_special_dtypes(model, bnb_quantization_config, quantized_modules)
    no_split = list(no_split_module_classes or getattr(model, "_no_split_modules", None) or [])
    if device_map == "sequential":
        budgets = get_max_memory(max_memory)
    else:
        budgets = get_balanced_memory(
            model,
            max_memory,
            no_split_module_classes=no_split,
            special_dtypes=special,
            low_zero=device_map == "balanced_low_0",
        )
    return infer_auto_device_map(
        model, max_memory=budgets, no_split_module_classes=no_split, special_dtypes=special
    )


def check_quantized_placement(
    config: Any,
    device_map: Mapping[str, Any],
    quantized_modules: set[str],
    offload_folder: Any,
) -> None:
    """Refuse, naming the fix, a map a quantized model cannot follow: 4-bit weights away from the
    device that computes (bitsandbytes cannot offload a 4-bit weight), torchao weights offloaded,
    or disk offload without an ``offload_folder``."""
    main = main_device(device_map)
    away = {d for d in device_map.values() if d != main and not isinstance(d, int)}
    if "disk" in away and offload_folder is None:
        raise ValueError(
            "device_map sends modules to 'disk' but no offload_folder was given: pass "
            "offload_folder=... (the quantized weights are written there once)."
        )
    if not away:
        return
    offloaded = [
        name
        for name, dev in device_map.items()
        if dev in away
        and any(q == name or q.startswith(name + ".") or name.startswith(q + ".") or not name
                for q in quantized_modules)
    ]  # fmt: skip
    if not offloaded:
        return
    where = ", ".join(f"{n or '(whole model)'} -> {device_map[n]}" for n in offloaded[:5])
    if config.backend == "torchao":
        raise ValueError(
            f"device_map offloads torchao-quantized layers ({where}): torchao weights stay on "
            f"the device that computes ({main}). Map them to {main!r}, or use "
            "BnbQuantizationConfig(load_in_8bit=True), whose weights can be offloaded."
        )
    if config.bits == 4:
        raise ValueError(
            f"device_map sends 4-bit layers away from the device that computes ({where}; it "
            f"computes on {main!r}): bitsandbytes 4-bit weights cannot be offloaded. Map them to "
            f"{main!r}, list them in skip_modules (kept in torch_dtype), or load in 8-bit "
            "(BnbQuantizationConfig(load_in_8bit=True)), whose weights offload to cpu and disk."
        )
