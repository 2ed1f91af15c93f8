"""Device maps: plan where every module lives (``infer_auto_device_map``) and validate user maps.

When the model fits without offloading, the map is exactly Accelerate's (``greedy_fill``: a
sequential fill keeping the largest layer free on the main devices). When layers must be
offloaded to the CPU or the disk, nbaccel's own planner below is used instead. It walks the
module tree once per pass with a stack, reading sizes from one precomputed dictionary, so it
runs in time linear in modules and tensors. It packs devices in order (GPU 0, GPU 1, ..., cpu,
disk) with three differences from a naive sequential fill:

- the memory kept free on the execution device for offloaded layers is the size of the layers
  that actually end up offloaded (found by re-planning, at most a few linear passes), not a guess;
- a layer too big for a device even when that device is empty is placed further down without
  giving up the device, so one huge first layer does not send everything after it to the CPU;
- tied parameters are placed together and counted once.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Mapping

import torch
from torch import nn

from nbaccel.bigmodel.greedy_fill import GreedyFill, greedy_fill
from nbaccel.bigmodel.memory_budgets import get_balanced_memory, get_max_memory
from nbaccel.bigmodel.module_sizes import ModelScan, modules_preorder, no_gc

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


def _ancestors(name: str):
    """'a.b.c' -> 'a.b', 'a', '' (proper ancestors, nearest first)."""
    end = name.rfind(".")
    while end != -1:
        yield name[:end]
        end = name.rfind(".", 0, end)
    if name:
        yield ""


def _lookup(name: str, device_map: Mapping[str, object]):
    """Device of tensor or module ``name``: its own entry or its nearest mapped ancestor."""
    if name in device_map:
        return device_map[name]
    for parent in _ancestors(name):
        if parent in device_map:
            return device_map[parent]
    raise KeyError(name)


class _Plan:
    """One sequential packing pass with fixed per-device reserves."""

    def __init__(self, ctx: _Context, reserves: Mapping[int | str, int]):
        self.ctx = ctx
        self.devices = ctx.devices
        self.caps = [ctx.budgets[d] - reserves.get(d, 0) for d in self.devices]
        self.used = [0] * len(self.devices)
        self.result: dict[str, int | str] = {}
        self.preplaced: dict[str, int] = {}
        self.reduced: dict[str, int] = {}
        self.sizes_by_device: dict[int | str, list[int]] = {d: [] for d in self.devices}

    def eff(self, name: str, module: nn.Module | None = None) -> int:
        """Bytes of a unit still to place (minus tied pieces already placed elsewhere)."""
        return self.ctx.size(name, module) - self.reduced.get(name, 0)

    def _inside(self, name: str, unit: str) -> bool:
        return unit == "" or name == unit or name.startswith(unit + ".")

    def _assigned(self, name: str) -> bool:
        if name in self.result or name in self.preplaced:
            return True
        return any(p in self.result or p in self.preplaced for p in _ancestors(name))

    def _partners(self, unit: str) -> list[str]:
        found: list[str] = []
        for gi in self.ctx.tied_under.get(unit, ()):
            for other in self.ctx.tied_groups[gi]:
                owner = self.ctx.owner[other]
                if self._inside(owner, unit) or owner in found or self._assigned(owner):
                    continue
                found.append(owner)
        return found

    def _place(
        self, unit: str, module: nn.Module | None, i: int, size: int, partners: list[str]
    ) -> None:
        dev = self.devices[i]
        self.result[unit] = dev
        self.used[i] += size
        self.sizes_by_device[dev].append(self.eff(unit, module))
        ctx = self.ctx
        if dev in ctx.offload_devices and not ctx.offload_buffers and module is not None:
            # Buffers of offloaded layers stay resident on the execution device.
            self.used[ctx.main_index] += ctx.scan.buffers_by_id.get(id(module), 0)
        for owner in partners:
            owner_size = self.eff(owner)
            self.preplaced[owner] = i
            self.sizes_by_device[dev].append(owner_size)
            for parent in _ancestors(owner):
                self.reduced[parent] = self.reduced.get(parent, 0) + owner_size
        if ctx.verbose:
            extra = f" with tied {partners}" if partners else ""
            print(f"Putting {unit or '(model)'} ({size} bytes){extra} on {dev!r}.")

    def run(self) -> dict[str, int | str]:
        ctx = self.ctx
        ptr = 0
        last = len(self.devices) - 1
        stack: list[tuple[str, nn.Module | None]] = [("", ctx.model)]
        while stack:
            name, module = stack.pop()
            if name in self.preplaced:
                self.result[name] = self.devices[self.preplaced[name]]
                continue
            partners = self._partners(name) if name in ctx.tied_under else []
            need = self.eff(name, module) + sum(self.eff(p) for p in partners)
            must_split = name in self.reduced and module is not None
            if not must_split and self.used[ptr] + need <= self.caps[ptr]:
                self._place(name, module, ptr, need, partners)
                continue
            if module is not None and (must_split or self._splittable(module)):
                stack.extend(reversed(self._pieces(name, module)))
                continue
            # An unsplittable layer that does not fit the current device.
            for j in range(ptr + 1, last + 1):
                if self.used[j] + need <= self.caps[j]:
                    break
            else:
                raise ValueError(
                    f"{name!r} ({need} bytes) fits on no device: raise max_memory or add 'disk' "
                    "to it."
                )
            if need <= self.caps[ptr]:
                ptr = j  # the current device is full: move on, keeping the map sequential
            # else: the layer could never fit on the current device; keep filling it afterwards.
            self._place(name, module, j, need, partners)
        return self.result

    def _splittable(self, module: nn.Module) -> bool:
        # Leaves stay whole (a Linear's weight and bias must share a device).
        return bool(module._modules) and type(module).__name__ not in self.ctx.no_split

    def _pieces(self, name: str, module: nn.Module) -> list[tuple[str, nn.Module | None]]:
        prefix = name + "." if name else ""
        pieces: list[tuple[str, nn.Module | None]] = []
        ctx = self.ctx
        for store in (module._parameters, module._buffers):
            for leaf, tensor in store.items():
                if tensor is None:
                    continue
                full = prefix + leaf
                if full not in ctx.tensor_sizes:  # only computed when a module splits
                    ctx.tensor_sizes[full] = ctx.scan.tensor_size(full, tensor)
                pieces.append((full, None))
        pieces.extend((prefix + k, m) for k, m in module._modules.items() if m is not None)
        return pieces


class _Context:
    """Everything a pass needs, computed once."""

    def __init__(
        self, model, max_memory, no_split, dtype, special_dtypes, offload_buffers, verbose
    ):
        self.model = model
        budgets: dict[int | str, float] = dict(get_max_memory(max_memory))
        if "disk" not in budgets:
            budgets["disk"] = math.inf
        self.budgets = budgets
        self.devices = list(budgets)
        self.no_split = set(no_split or ())
        self.offload_buffers = offload_buffers
        self.verbose = verbose
        gpu_like = [d for d in self.devices if d not in _OFFLOAD]
        self.main = gpu_like[0] if gpu_like else "cpu"
        if self.main not in budgets:  # no cpu budget given and no GPU: plan onto disk
            self.main = self.devices[0]
        self.main_index = self.devices.index(self.main)
        self.offload_devices = {"disk"} if self.main == "cpu" else {"cpu", "disk"}
        scan = ModelScan(model, dtype, special_dtypes)
        self.scan = scan
        self.tensor_sizes: dict[str, int] = {}
        self.tied_groups = scan.tied_groups
        self.owner: dict[str, str] = {}
        self.tied_under: dict[str, list[int]] = {}
        if self.tied_groups:
            modules = dict(scan.modules)
            for gi, group in enumerate(self.tied_groups):
                for pname in group:
                    self.owner[pname] = self._owner(pname, modules)
                    for prefix in (pname, *_ancestors(pname)):
                        self.tied_under.setdefault(prefix, []).append(gi)

    def size(self, name: str, module: nn.Module | None = None) -> int:
        """Bytes under a module (found by identity, no name needed) or a tensor unit."""
        if module is not None:
            return self.scan.size_by_id.get(id(module), 0)
        found = self.tensor_sizes.get(name)
        if found is not None:
            return found
        try:  # a tied owner named by the plan
            target = self.model.get_submodule(name) if name else self.model
            return self.scan.size_by_id.get(id(target), 0)
        except AttributeError:
            owner_name, _, leaf = name.rpartition(".")
            owner = self.model.get_submodule(owner_name) if owner_name else self.model
            tensor = owner._parameters.get(leaf)
            if tensor is None:
                tensor = owner._buffers[leaf]
            self.tensor_sizes[name] = self.scan.tensor_size(name, tensor)
            return self.tensor_sizes[name]

    def _owner(self, pname: str, modules: Mapping[str, nn.Module]) -> str:
        """The unit a tied parameter moves with: its outermost no-split ancestor, else its module
        (or the tensor itself when that module has children and may be split)."""
        for prefix in reversed(list(_ancestors(pname))):
            if prefix and type(modules[prefix]).__name__ in self.no_split:
                return prefix
        parent = pname.rpartition(".")[0]
        return pname if modules[parent]._modules else parent


def _reserves(ctx: _Context, plan: _Plan) -> dict[int | str, int]:
    offloaded = sorted(
        (
            s
            for d in ctx.offload_devices
            if d in plan.sizes_by_device
            for s in plan.sizes_by_device[d]
        ),
        reverse=True,
    )
    if not offloaded:
        return {}
    reserves: dict[int | str, int] = {}
    # A GPU executing offloaded layers holds the running layer and the one being prefetched.
    reserves[ctx.main] = offloaded[0]
    if isinstance(ctx.main, int) and sum(offloaded[:2]) < ctx.budgets[ctx.main]:
        reserves[ctx.main] = sum(offloaded[:2])
    disk = sorted(plan.sizes_by_device.get("disk", []), reverse=True)
    if disk and "cpu" in ctx.budgets and ctx.main != "cpu":
        reserves["cpu"] = disk[0]
    # A layer bigger than the execution device cannot be streamed onto it whatever is kept free;
    # reserving would only evict everything else, so such reserves are dropped.
    return {d: r for d, r in reserves.items() if r < ctx.budgets[d]}


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
) -> dict[str, int | str]:
    """Map module names to devices, filling GPUs in order, then cpu, then disk.

    ``no_split_module_classes`` names blocks kept whole (residual blocks). Tied parameters share
    a device. If the model fits on the execution devices the map is Accelerate's (the largest
    layer kept free on GPU 0 and the CPU; ``fallback_allocation`` lets a device that would stay
    empty take a smaller later piece). If layers must be offloaded, the room kept on the
    execution device is the size of the layers actually offloaded (running + prefetched), and a
    device is never left empty while a later layer fits on it.
    """
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""))
    if isinstance(no_split_module_classes, str):
        no_split_module_classes = [no_split_module_classes]
    with no_gc():
        budgets = get_max_memory(max_memory)
        ctx = _Context(
            model, budgets, no_split_module_classes, dtype, special_dtypes, offload_buffers, verbose
        )
        sizes, buffer_sizes = ctx.scan.sizes, ctx.scan.buffer_sizes
        fill = greedy_fill(
            model,
            budgets,
            sizes,
            buffer_sizes,
            ctx.tied_groups,
            ctx.no_split,
            offload_buffers=offload_buffers,
            fallback_allocation=fallback_allocation,
            verbose=verbose,
        )
        if any(dev in ctx.offload_devices for dev in fill.device_map.values()):
            result = _infer(ctx)
            used: dict[int | str, float] = {}
            for name, dev in result.items():
                used[dev] = used.get(dev, 0) + sizes.get(name, 0)
            buffers = {}
            if not offload_buffers:
                for name, dev in result.items():
                    buffers[dev] = buffers.get(dev, 0) + buffer_sizes.get(name, 0)
            empty = {d: m for d, m in fill.empty_minimum.items() if d not in used}
            fill = GreedyFill(result, used, buffers, empty)
        _warn(fill, budgets, offload_buffers)
        result = fill.device_map
    return clean_device_map(result) if clean_result else result


def _warn(fill: GreedyFill, budgets: Mapping[int | str, int], offload_buffers: bool) -> None:
    """Accelerate's diagnostics: offloaded buffers that no GPU can hold, and devices left empty."""
    offloaded = fill.buffers_by_device.get("cpu", 0) + fill.buffers_by_device.get("disk", 0)
    gpus = [d for d in budgets if d not in _OFFLOAD]
    fits_a_gpu = any(budgets[g] >= offloaded + fill.used.get(g, 0) for g in gpus)
    if offloaded > 0 and not offload_buffers and gpus and not fits_a_gpu:
        warnings.warn(
            f"The layers offloaded to cpu/disk hold {offloaded:g} bytes of buffers, which do "
            "not fit in the remaining memory of any GPU; they are kept on the execution "
            "device during inference. If you run out of memory, pass offload_buffers=True.",
            stacklevel=3,
        )
    if fill.empty_minimum:
        lines = "\n".join(f"  - {d}: {m:g} bytes required" for d, m in fill.empty_minimum.items())
        logger.info(
            "No module could be assigned to the following devices due to insufficient "
            f"memory:\n{lines}\nRaise their budget in max_memory to at least these amounts "
            "(specific to this model and plan) or pass fallback_allocation=True."
        )


def _infer(ctx: _Context) -> dict[str, int | str]:
    plan = _Plan(ctx, {})
    result = plan.run()
    reserves = _reserves(ctx, plan)
    for _ in range(4):
        if not reserves or all(v <= 0 for v in reserves.values()):
            break
        plan = _Plan(ctx, reserves)
        result = plan.run()
        needed = _reserves(ctx, plan)
        if all(needed.get(d, 0) <= reserves.get(d, 0) for d in needed):
            break
        reserves = {
            d: max(needed.get(d, 0), reserves.get(d, 0)) for d in set(needed) | set(reserves)
        }
    return result


def clean_device_map(device_map: Mapping[str, int | str]) -> dict[str, int | str]:
    """Collapse entries: a module whose every mapped piece is on one device becomes one entry."""
    devices_under: dict[str, set] = {}
    for name, dev in device_map.items():
        for prefix in (name, *_ancestors(name)):
            devices_under.setdefault(prefix, set()).add(dev)
    cleaned: dict[str, int | str] = {}
    for name, dev in device_map.items():
        chosen = name
        for prefix in reversed([name, *_ancestors(name)]):  # outermost first
            if len(devices_under[prefix]) == 1:
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
) -> dict[str, int | str] | None:
    """Turn ``"auto" | "balanced" | "balanced_low_0" | "sequential"`` or a single device into a
    checked device map; a dict is normalised and checked."""
    if device_map is None:
        return None
    if isinstance(device_map, str) and device_map in DEVICE_MAP_STRINGS:
        if device_map == "sequential":
            budgets = get_max_memory(max_memory)
        else:
            budgets = get_balanced_memory(
                model,
                max_memory,
                no_split_module_classes=no_split_module_classes,
                dtype=dtype,
                low_zero=device_map == "balanced_low_0",
            )
        return infer_auto_device_map(
            model,
            max_memory=budgets,
            no_split_module_classes=no_split_module_classes,
            dtype=dtype,
            offload_buffers=offload_buffers,
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
