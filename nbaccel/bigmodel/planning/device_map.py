"""Device maps: plan where every module lives (``infer_auto_device_map``) and validate user maps.

The plan is Accelerate's (``greedy_fill``: a sequential fill keeping the largest layer free on
the main devices), computed in time linear in the model, so code and tests written for
Accelerate get the same map. ``offload_aware=True`` asks for nbaccel's own plan when layers
must be offloaded (``offload_planner``: the room kept is the size of the layers actually
offloaded, and one huge layer does not push everything after it off the GPUs).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping

import torch
from torch import nn

from nbaccel.bigmodel.planning.greedy_fill import GreedyFill, greedy_fill
from nbaccel.bigmodel.planning.memory_budgets import get_balanced_memory, get_max_memory
from nbaccel.bigmodel.planning.module_sizes import ModelScan, modules_preorder, no_gc
from nbaccel.bigmodel.planning.offload_planner import ancestors, plan_offloaded

__all__ = [
    "DEVICE_MAP_STRINGS",
    "check_device_map",
    "clean_device_map",
    "get_device_map",
    "infer_auto_device_map",
    "normalize_device",
]

DEVICE_MAP_STRINGS = ("auto", "balanced", "balanced_low_0", "sequential")
_OFFLOAD = ("cpu", "disk")
logger = logging.getLogger(__name__)


def normalize_device(device: int | str | torch.device, where: str = "") -> int | str:
    """A device-map value as int (GPU id) or one of 'cpu', 'disk', 'mps', 'meta' or 'xpu:0'..."""
    at = f" for {where!r}" if where else ""
    if isinstance(device, torch.device):
        if device.type == "cuda":
            return device.index or 0
        if device.type in {"cpu", "mps", "meta"}:
            return device.type
        return str(device)
    if isinstance(device, bool):
        raise ValueError(f"Invalid device {device!r}{at}.")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"Invalid GPU id {device}{at}: GPU ids are integers >= 0.")
        return device
    if isinstance(device, str):
        low = device.strip().lower()
        if low in {"cpu", "disk", "mps", "meta"}:
            return low
        if low == "cuda":
            return 0
        if low.isdigit():
            return int(low)
        kind, _, index = low.partition(":")
        if kind == "cuda" and index.isdigit():
            return int(index)
        if kind in {"xpu", "npu", "mlu", "musa", "hpu"} and (index.isdigit() or not index):
            return f"{kind}:{index or 0}"
    raise ValueError(
        f"Unknown device {device!r}{at}: use a GPU id (0, 1, ... or 'cuda:0'), 'mps', 'cpu' or "
        "'disk'."
    )


def _lookup(name: str, device_map: Mapping[str, object]):
    """Device of tensor or module ``name``: its own entry or its nearest mapped ancestor."""
    if name in device_map:
        return device_map[name]
    for parent in ancestors(name):
        if parent in device_map:
            return device_map[parent]
    raise KeyError(name)


def infer_auto_device_map(
    model: nn.Module,
    max_memory: Mapping[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
    *,
    offload_aware: bool = False,
    scan: ModelScan | None = None,
    absent_gpus: str = "plan",
) -> dict[str, int | str]:
    """Map module names to devices, filling GPUs in order, then cpu, then disk (Accelerate's map).

    ``no_split_module_classes`` names blocks kept whole (residual blocks). Tied parameters share
    a device. The largest layer is kept free on GPU 0 and the CPU in case an offloaded layer
    runs there; ``fallback_allocation`` lets a device that would stay empty take a smaller later
    piece. ``offload_aware=True`` (nbaccel only): when layers must be offloaded, keep only the
    size of the layers actually offloaded (running + prefetched) free on the execution device,
    and never leave a device empty while a later layer fits on it. ``scan``: the model's sizes
    when the caller already has them (same ``dtype``s; see ``get_device_map``).
    ``max_memory`` keys naming GPUs this machine does not have are planned for (a map for a
    machine that has them) or, with ``absent_gpus="drop"``, left out; said in one line.
    """
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""))
    if isinstance(no_split_module_classes, str):
        no_split_module_classes = [no_split_module_classes]
    no_split = set(no_split_module_classes or ())
    with no_gc():
        budgets = get_max_memory(max_memory, absent_gpus=absent_gpus)
        if scan is None:
            scan = ModelScan(model, dtype, special_dtypes, whole=no_split)
        fill = greedy_fill(
            model,
            budgets,
            scan,
            no_split,
            offload_buffers=offload_buffers,
            fallback_allocation=fallback_allocation,
            verbose=verbose,
        )
        if offload_aware and _offloads(fill, budgets):
            fill = _offload_aware(model, budgets, scan, no_split, fill, offload_buffers, verbose)
        _warn(fill, budgets, offload_buffers)
        result = fill.device_map
    return clean_device_map(result) if clean_result else result


def _offloads(fill: GreedyFill, budgets: Mapping[int | str, int]) -> bool:
    gpu_like = any(d not in _OFFLOAD for d in budgets)
    offload = ("cpu", "disk") if gpu_like else ("disk",)
    return any(dev in offload for dev in fill.device_map.values())


def _offload_aware(model, budgets, scan, no_split, fill, offload_buffers, verbose) -> GreedyFill:
    """nbaccel's plan, with the numbers the diagnostics need."""
    result = plan_offloaded(model, budgets, scan, no_split, offload_buffers, verbose)
    modules = dict(scan.modules)
    used: dict[int | str, float] = {}
    buffers: dict[int | str, float] = {}
    for name, dev in result.items():
        piece = modules.get(name)
        if piece is None:  # a tensor unit
            owner, _, leaf = name.rpartition(".")
            holder = modules[owner]
            piece = holder._parameters.get(leaf)
            piece = holder._buffers[leaf] if piece is None else piece
        used[dev] = used.get(dev, 0) + scan.piece_size(name, piece)
        if not offload_buffers and isinstance(piece, nn.Module):
            buffers[dev] = buffers.get(dev, 0) + scan.piece_buffers(name, piece)
    empty = {d: m for d, m in fill.empty_minimum.items() if d not in used}
    return GreedyFill(result, used, buffers, empty)


def _warn(fill: GreedyFill, budgets: Mapping[int | str, int], offload_buffers: bool) -> None:
    """Accelerate's diagnostics: offloaded buffers that no GPU can hold, and devices left empty."""
    offloaded = fill.buffers_by_device.get("cpu", 0) + fill.buffers_by_device.get("disk", 0)
    gpus = [d for d in budgets if d not in _OFFLOAD]
    fits_a_gpu = any(budgets[g] >= offloaded + fill.used.get(g, 0) for g in gpus)
    if offloaded > 0 and not offload_buffers and gpus and not fits_a_gpu:
        warnings.warn(
            f"Current model requires {offloaded:g} bytes of buffer for offloaded layers: the "
            "layers on cpu/disk keep their buffers on the execution device during inference, "
            "and they do not fit in the remaining memory of any GPU. If you run out of memory, "
            "pass offload_buffers=True.",
            stacklevel=3,
        )
    if fill.empty_minimum:
        lines = "\n".join(f"  - {d}: {m:g} bytes required" for d, m in fill.empty_minimum.items())
        logger.info(
            "No module could be assigned to the following devices due to insufficient "
            f"memory:\n{lines}\nRaise their budget in max_memory to at least these amounts "
            "(specific to this model and plan) or pass fallback_allocation=True."
        )


def clean_device_map(device_map: Mapping[str, int | str]) -> dict[str, int | str]:
    """Collapse entries: a module with more than one mapped piece under it, all on one device,
    becomes one entry (the outermost such module wins; ``""`` when the whole model is on one)."""
    devices_under: dict[str, set] = {}
    count_under: dict[str, int] = {}
    for name in device_map:
        dev = device_map[name]
        for prefix in ancestors(name):
            devices_under.setdefault(prefix, set()).add(dev)
            count_under[prefix] = count_under.get(prefix, 0) + 1
    cleaned: dict[str, int | str] = {}
    for name, dev in device_map.items():
        chosen = name
        for prefix in reversed(list(ancestors(name))):  # outermost first
            if count_under[prefix] > 1 and len(devices_under[prefix]) == 1:
                chosen = prefix
                break
        if chosen not in cleaned:
            cleaned[chosen] = dev
    return cleaned


def _shorten(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_device_map(model: nn.Module, device_map: Mapping[str, int | str | torch.device]) -> None:
    """Raise ValueError unless ``device_map`` names valid devices and covers every parameter and
    buffer (the message lists each one it misses); warn about names the model does not have."""
    if not isinstance(device_map, Mapping):
        raise TypeError(
            f"device_map must be a dict of module name -> device, got {type(device_map).__name__}."
        )
    for key, value in device_map.items():
        normalize_device(value, where=key)
    modules = set()
    tensors = []
    for name, module in modules_preorder(model):
        modules.add(name)
        pre = name + "." if name else ""
        for store in (module._parameters, module._buffers):
            tensors.extend(pre + leaf for leaf, t in store.items() if t is not None)
    known = modules.union(tensors)
    unknown = [k for k in device_map if k not in known]
    if unknown:
        warnings.warn(
            f"device_map keys do not match any submodules or tensors of the model: "
            f"{_shorten(unknown)}. Keys must be module names from model.named_modules() or "
            "tensor names (use '' for the whole model); those entries are ignored.",
            UserWarning,
            stacklevel=2,
        )
    missing = []
    for name in tensors:
        try:
            _lookup(name, device_map)
        except KeyError:
            missing.append(name)
    if missing:
        raise ValueError(
            f"device_map does not place {len(missing)} tensor(s): {_shorten(missing)}. Add an "
            "entry for each of them or for a parent module (for example "
            f"{{{missing[0].rpartition('.')[0] or missing[0]!r}: 'cpu'}}), or pass "
            "device_map='auto'."
        )


def get_device_map(
    model: nn.Module,
    device_map: str | Mapping[str, int | str | torch.device] | int | torch.device | None,
    max_memory: Mapping[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: torch.dtype | str | None = None,
    offload_buffers: bool = False,
    *,
    absent_gpus: str = "plan",
) -> dict[str, int | str] | None:
    """Turn ``"auto" | "balanced" | "balanced_low_0" | "sequential"`` or a single device into a
    checked device map; a dict is normalised and checked. ``absent_gpus``: what the plan does with
    ``max_memory``'s GPUs that this machine does not have (see ``infer_auto_device_map``)."""
    if device_map is None:
        return None
    if isinstance(device_map, str) and device_map in DEVICE_MAP_STRINGS:
        if isinstance(no_split_module_classes, str):
            no_split_module_classes = [no_split_module_classes]
        with no_gc():  # one scan of the model serves the budgets and the map
            scan = ModelScan(model, dtype, whole=set(no_split_module_classes or ()))
        if device_map == "sequential":
            budgets = get_max_memory(max_memory, absent_gpus=absent_gpus)
        else:
            budgets = get_balanced_memory(
                model,
                max_memory,
                no_split_module_classes=no_split_module_classes,
                dtype=dtype,
                low_zero=device_map == "balanced_low_0",
                scan=scan,
                absent_gpus=absent_gpus,
            )
        return infer_auto_device_map(
            model,
            max_memory=budgets,
            no_split_module_classes=no_split_module_classes,
            dtype=dtype,
            offload_buffers=offload_buffers,
            scan=scan,
        )
    if isinstance(device_map, str | int | torch.device):
        try:
            return {"": normalize_device(device_map)}
        except ValueError:
            raise ValueError(
                f"Unknown device_map {device_map!r}: use one of {', '.join(DEVICE_MAP_STRINGS)}, "
                "a device ('cpu', 'disk', 0), or a dict of module name -> device."
            ) from None
    check_device_map(model, device_map)
    return {k: normalize_device(v, where=k) for k, v in device_map.items()}
