"""Memory budgets per device: parsing ``max_memory`` (``"10GiB"``, ``"cuda:0"``, ...), measuring
free memory, and lowering GPU budgets so a model spreads evenly (``get_balanced_memory``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import psutil
import torch
from torch import nn

from nbaccel.bigmodel.module_sizes import compute_module_sizes, get_max_layer_size

__all__ = [
    "convert_file_size_to_int",
    "get_balanced_memory",
    "get_max_memory",
]

_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)


def convert_file_size_to_int(size: int | float | str) -> int:
    """Parse ``"10GiB"`` (2**30), ``"5GB"`` (10**9), ``"500MB"``, ``"1.5GiB"`` or a byte count."""
    if isinstance(size, bool):
        raise ValueError(
            f"Invalid memory size {size!r}: give bytes as an int or a string like '10GiB'."
        )
    if isinstance(size, int | float):
        if size < 0:
            raise ValueError(f"Invalid memory size {size!r}: sizes cannot be negative.")
        return int(size)
    if isinstance(size, str):
        match = _SIZE_RE.match(size)
        if match:
            number, unit = match.groups()
            return int(float(number) * _UNITS[(unit or "B").upper()])
    raise ValueError(
        f"Invalid memory size {size!r}: use an int number of bytes or a string such as "
        "'10GiB', '5GB', '512MiB' or '800MB' (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)."
    )


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


def get_max_memory(max_memory: Mapping[int | str, int | str] | None = None) -> dict[int | str, int]:
    """Memory budget per device in bytes, ordered GPU ids first, then mps, cpu and disk.

    Without ``max_memory`` the free memory of every visible GPU and the available RAM are used.
    Strings like ``"10GiB"`` or ``"5GB"`` are parsed; GPU ids need not exist (planning only).
    """
    if max_memory is None:
        found: dict[int | str, int] = {}
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                found[i] = torch.cuda.mem_get_info(i)[0]
        elif torch.backends.mps.is_available():
            found["mps"] = psutil.virtual_memory().available
        found["cpu"] = psutil.virtual_memory().available
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
    return {k: parsed[k] for k in sorted(parsed, key=_device_rank)}


def _execution_gpus(max_memory: Mapping[int | str, int]) -> list[int]:
    return [k for k in max_memory if isinstance(k, int)]


def get_balanced_memory(
    model: nn.Module,
    max_memory: Mapping[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype] | None = None,
    low_zero: bool = False,
) -> dict[int | str, int]:
    """Lower the GPU budgets so a sequential device map spreads the model evenly over the GPUs.

    With ``low_zero`` GPU 0 only receives what does not fit on the others (room for generation
    outputs). Budgets are unchanged when the model does not fit on the GPUs anyway.
    """
    budgets = get_max_memory(max_memory)
    gpus = _execution_gpus(budgets)
    targets = gpus[1:] if low_zero else gpus
    if not targets:
        return budgets
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    total = sizes.get("", 0)
    if total > sum(budgets[g] for g in targets):
        return budgets
    largest, _ = get_max_layer_size(list(model.named_children()), sizes, no_split_module_classes)
    # Each GPU but the last gets its share plus half a layer of slack for packing granularity;
    # the last keeps its whole budget so leftovers land on a GPU rather than the CPU.
    share = -(-total // len(targets)) + largest // 2
    balanced = dict(budgets)
    for g in targets[:-1]:
        balanced[g] = min(budgets[g], share)
    if low_zero:
        rest = sum(balanced[g] for g in targets)
        balanced[gpus[0]] = min(budgets[gpus[0]], max(0, total - rest))
    return balanced
