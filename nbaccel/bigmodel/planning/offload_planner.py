"""nbaccel's own plan for models that must be offloaded (``infer_auto_device_map(...,
offload_aware=True)``).

Accelerate keeps the size of the largest layer free on the execution device whenever anything
is offloaded. This planner instead packs devices in order (GPU 0, GPU 1, ..., cpu, disk) with
three differences:

- the memory kept free on the execution device for offloaded layers is the size of the layers
  that actually end up offloaded (found by re-planning, at most a few linear passes), not a guess;
- a layer too big for a device even when that device is empty is placed further down without
  giving up the device, so one huge first layer does not send everything after it to the CPU;
- tied parameters are placed together and counted once.

It walks the module tree once per pass with a stack, reading sizes from one ``ModelScan``, so
it runs in time linear in modules and tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from torch import nn

from nbaccel.bigmodel.planning.module_sizes import ModelScan

__all__ = ["ancestors", "plan_offloaded"]

_OFFLOAD = ("cpu", "disk")


def ancestors(name: str):
    """'a.b.c' -> 'a.b', 'a', '' (proper ancestors, nearest first)."""
    end = name.rfind(".")
    while end != -1:
        yield name[:end]
        end = name.rfind(".", 0, end)
    if name:
        yield ""


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
        return any(p in self.result or p in self.preplaced for p in ancestors(name))

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
            self.used[ctx.main_index] += ctx.scan.piece_buffers(unit, module)
        for owner in partners:
            owner_size = self.eff(owner)
            self.preplaced[owner] = i
            self.sizes_by_device[dev].append(owner_size)
            for parent in ancestors(owner):
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

    def __init__(self, model, max_memory, scan, no_split, offload_buffers, verbose):
        self.model = model
        budgets: dict[int | str, float] = dict(max_memory)
        if "disk" not in budgets:
            budgets["disk"] = math.inf
        self.budgets = budgets
        self.devices = list(budgets)
        self.no_split = no_split
        self.offload_buffers = offload_buffers
        self.verbose = verbose
        gpu_like = [d for d in self.devices if d not in _OFFLOAD]
        self.main = gpu_like[0] if gpu_like else "cpu"
        if self.main not in budgets:  # no cpu budget given and no GPU: plan onto disk
            self.main = self.devices[0]
        self.main_index = self.devices.index(self.main)
        self.offload_devices = {"disk"} if self.main == "cpu" else {"cpu", "disk"}
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
                    for prefix in (pname, *ancestors(pname)):
                        self.tied_under.setdefault(prefix, []).append(gi)

    def size(self, name: str, module: nn.Module | None = None) -> int:
        """Bytes under a module or a tensor unit."""
        if module is not None:
            return self.scan.piece_size(name, module)
        found = self.tensor_sizes.get(name)
        if found is not None:
            return found
        try:  # a tied owner named by the plan
            target = self.model.get_submodule(name) if name else self.model
            return self.scan.piece_size(name, target)
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
        for prefix in reversed(list(ancestors(pname))):
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


def plan_offloaded(
    model: nn.Module,
    budgets: Mapping[int | str, float],
    scan: ModelScan,
    no_split: set[str],
    offload_buffers: bool = False,
    verbose: bool = False,
) -> dict[str, int | str]:
    """The (unclean) map of nbaccel's offload-aware plan over ``budgets`` (bytes, in order)."""
    return _infer(_Context(model, budgets, scan, no_split, offload_buffers, verbose))
