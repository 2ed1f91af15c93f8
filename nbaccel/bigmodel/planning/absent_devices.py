"""``max_memory`` keys naming devices this machine does not have: planned for (the default: plan
on a laptop, run on the cluster) or left out (``absent_gpus="drop"``, Accelerate's way), and
said in one line either way.

A GPU id at or past ``torch.cuda.device_count()``, or ``"mps"`` without MPS, is absent. With
``absent_gpus="plan"`` it stays in the plan with the budget given and the line says the map is for
a machine that has it (loading such a map here then fails, naming the GPU). With
``absent_gpus="drop"`` the plan leaves it out and the line names the devices used instead.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["ABSENT_GPU_MODES", "MemoryBudgets", "absent_devices", "resolve_absent"]

logger = logging.getLogger(__name__)

#: what a planner does with a ``max_memory`` device this machine does not have
ABSENT_GPU_MODES = ("plan", "drop")


class MemoryBudgets(dict):
    """Budgets in bytes per device, already parsed and checked against this machine: passed to
    ``get_max_memory`` again (by a planner that calls another), they are taken as they are and
    not reported twice."""


def _label(device: int | str) -> str:
    return f"cuda:{device}" if isinstance(device, int) else str(device)


def absent_devices(budgets: dict[int | str, int]) -> list[int | str]:
    """The keys of ``budgets`` naming a device this machine does not have (GPU ids, ``mps``)."""
    gpus = torch.cuda.device_count()
    absent: list[int | str] = [d for d in budgets if isinstance(d, int) and d >= gpus]
    if "mps" in budgets and not torch.backends.mps.is_available():
        absent.append("mps")
    return absent


def _have() -> str:
    count = torch.cuda.device_count()
    if count == 0:
        return "no CUDA GPU"
    return f"{count} CUDA GPU{'s' if count > 1 else ''}: " + ", ".join(map(_label, range(count)))


def resolve_absent(budgets: dict[int | str, int], absent_gpus: str = "plan") -> MemoryBudgets:
    """``budgets`` with the absent devices (``"plan"``) or without them (``"drop"``); one warning
    line naming them and what the plan does, when there are any."""
    if absent_gpus not in ABSENT_GPU_MODES:
        raise ValueError(
            f"absent_gpus={absent_gpus!r}: use 'plan' (keep GPUs this machine does not have in "
            "the plan) or 'drop' (leave them out)."
        )
    absent = absent_devices(budgets)
    if not absent:
        return MemoryBudgets(budgets)
    names = ", ".join(map(_label, absent))
    if absent_gpus == "plan":
        logger.warning(
            f"max_memory names {names}, which this machine does not have ({_have()}): planned "
            "for as given, a map for a machine that has them; absent_gpus='drop' leaves them out."
        )
        return MemoryBudgets(budgets)
    kept = MemoryBudgets({d: v for d, v in budgets.items() if d not in absent})
    rest = [_label(d) for d in kept] + ([] if "disk" in kept else ["disk"])
    logger.warning(
        f"max_memory names {names}, which this machine does not have ({_have()}): left out of "
        f"the plan (absent_gpus='drop'), which uses {', '.join(rest)}."
    )
    return kept
