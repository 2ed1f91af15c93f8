"""Memory budgets per device: parsing ``max_memory`` (``"10GiB"``, ``"cuda:0"``, ...), measuring
free memory, and lowering GPU budgets so a model spreads evenly (``get_balanced_memory``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from nbaccel.bigmodel.planning.absent_devices import MemoryBudgets, resolve_absent
from nbaccel.bigmodel.planning.module_sizes import ModelScan, no_gc
from nbaccel.bigmodel.planning.size_walk import leaf_bytes
from nbaccel.distributed.host_memory import available_memory
from nbaccel.values.sizes import parse_size

__all__ = [
    "convert_file_size_to_int",
    "get_balanced_memory",
    "get_max_memory",
]


def convert_file_size_to_int(size: int | float | str) -> int:
    """Parse ``"10GiB"`` (2**30), ``"5GB"`` (10**9), ``"500MB"``, ``"1.5GiB"`` or a byte count
    (the grammar of :mod:`nbaccel.values.sizes`)."""
    return parse_size(size, "memory size")


def _memory_key(key: int | str | torch.device) -> int | str:
    """Normalise a max_memory / device-map key: GPU ids become ints; cpu, mps, disk stay strings."""
    if isinstance(key, torch.device):
        key = str(key)
    if isinstance(key, bool):
        raise ValueError(f"Invalid device {key!r}.")
    if isinstance(key, int):
        if key < 0:
            raise ValueError(f"Invalid GPU id {key}: GPU ids are integers >= 0.")
        return key
    if isinstance(key, str):
        low = key.strip().lower()
        if low in {"cpu", "disk", "mps"}:
            return low
        if low.isdigit():
            return int(low)
        if low.startswith("cuda:") and low[5:].isdigit():
            return int(low[5:])
        if low == "cuda":
            return 0
    raise ValueError(
        f"Unknown device {key!r}: use a GPU id (0, 1, ... or 'cuda:0'), 'mps', 'cpu' or 'disk'."
    )


def _device_rank(key: int | str) -> tuple[int, int]:
    order = {"mps": 1, "cpu": 2, "disk": 3}
    return (0, key) if isinstance(key, int) else (order[key], 0)


def get_max_memory(
    max_memory: Mapping[int | str, int | str] | None = None, *, absent_gpus: str = "plan"
) -> dict[int | str, int]:
    """Memory budget per device in bytes, ordered GPU ids first, then mps, cpu and disk.

    Without ``max_memory`` the free memory of every visible GPU and the available RAM are used
    (RAM within a cgroup limit, where one applies: a container's is the budget, not the host's).
    Strings like ``"10GiB"`` or ``"5GB"`` are parsed. A key naming a device this machine does
    not have (GPU 1 on a one-GPU machine, any GPU on a laptop) is kept, planning for a machine
    that has it (``absent_gpus="plan"``), or left out (``"drop"``, Accelerate's way); one
    warning line names it either way (:mod:`nbaccel.bigmodel.planning.absent_devices`).
    """
    if isinstance(max_memory, MemoryBudgets):  # checked already by the planner calling this one
        return MemoryBudgets(max_memory)
    if max_memory is None:
        found = MemoryBudgets()
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                found[i] = torch.cuda.mem_get_info(i)[0]
        elif torch.backends.mps.is_available():
            found["mps"] = available_memory()
        found["cpu"] = available_memory()
        return found
    parsed: dict[int | str, int] = {}
    for key, value in max_memory.items():
        norm = _memory_key(key)
        if norm in parsed:
            raise ValueError(f"max_memory names device {norm!r} twice ({key!r}).")
        try:
            parsed[norm] = convert_file_size_to_int(value)
        except ValueError as err:
            raise ValueError(f"max_memory[{key!r}]: {err}") from None
    ordered = {k: parsed[k] for k in sorted(parsed, key=_device_rank)}
    return resolve_absent(ordered, absent_gpus)


def _leaves(names) -> list[str]:
    """Names with no child name in ``names`` (the root excluded)."""
    parents = {n.rpartition(".")[0] for n in names if "." in n}
    return [n for n in names if n and n not in parents]


def get_balanced_memory(
    model: nn.Module,
    max_memory: Mapping[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype] | None = None,
    low_zero: bool = False,
    *,
    scan: ModelScan | None = None,
    absent_gpus: str = "plan",
) -> dict[int | str, int]:
    """Lower the GPU budgets so a sequential device map spreads the model evenly over the GPUs.

    Every GPU but the last gets the model size divided by the number of GPUs plus a margin of
    1.25 x the larger of the biggest ``no_split_module_classes`` block and the mean size of the
    last-level modules (Accelerate's rule, so ``device_map="balanced"`` gives the same map). With
    ``low_zero`` GPU 0 only receives what does not fit on the others (room for generation
    outputs). A single GPU with no ``max_memory`` given keeps 10% free. ``scan``: the model's
    sizes when the caller has them (a device map planned next reads the same scan).
    ``absent_gpus``: see :func:`get_max_memory`.
    """
    user_set = max_memory is not None
    budgets = get_max_memory(max_memory, absent_gpus=absent_gpus)
    gpus = sorted(k for k in budgets if isinstance(k, int) and budgets[k] > 0)
    count = len(gpus) + (1 if budgets.get("mps", 0) > 0 else 0)
    if count == 0:
        return budgets
    if count == 1:
        low_zero = False
        if not user_set and gpus:
            budgets[gpus[0]] = int(budgets[gpus[0]] * 0.9)
    if isinstance(no_split_module_classes, str):
        no_split_module_classes = [no_split_module_classes]
    wanted = set(no_split_module_classes or ())
    if scan is None:
        with no_gc():
            scan = ModelScan(model, dtype, special_dtypes, whole=wanted)
    total = scan.piece_size("", model)
    per_gpu = total // (count - 1 if low_zero else count)
    block = 0
    if wanted:
        found: dict[str, float] = {}
        for name, module in model.named_modules():
            cls = type(module).__name__
            if name and cls in wanted and cls not in found:
                found[cls] = scan.piece_size(name, module)
                if len(found) == len(wanted):
                    break
        block = max(found.values(), default=0)
    per_gpu += int(1.25 * max(block, _last_level_mean(model, scan)))
    for g in gpus[:-1]:
        budgets[g] = min(budgets[0] if low_zero and g == 0 else per_gpu, budgets[g])
    if low_zero:
        rest = sum(budgets.get(i, 0) for i in range(1, count))
        budgets[0] = min(max(0, total - rest), budgets[0])
    return budgets


def _last_level_mean(model: nn.Module, scan: ModelScan) -> int:
    """Mean size of the last-level modules: those holding bytes (ties counted once) with no
    child module holding any, the model itself excluded."""
    if scan.by_name:  # a shared module: its bytes count under its first name only
        sizes = scan.sizes
        named = [n for n, v in sizes.items() if v > 0]
        modules_only = set(named) - set(_leaves(named))  # drop the tensors
        last = _leaves(modules_only)
        return int(sum(sizes[n] for n in last) / max(len(last), 1))
    total = count = 0
    known = scan.size_by_id  # modules with children; leaves too when measured by name
    stack = [model]
    while stack:
        module = stack.pop()
        holds = False
        for child in module._modules.values():
            if child is None:
                continue
            bytes_under = known.get(id(child))  # by identity: no name is built
            if bytes_under is None:
                bytes_under = sum(leaf_bytes(child))
            if bytes_under > 0:
                holds = True
                if child._modules:
                    stack.append(child)
                else:
                    total, count = total + bytes_under, count + 1
        if not holds and module is not model:  # its bytes are its own tensors'
            total, count = total + known[id(module)], count + 1
    return int(total / max(count, 1))
