"""The notebook's torch settings, given to each rank as it starts.

Ranks are forked from a fork server that imported torch before the notebook ran a line, so a
rank would otherwise start from torch's defaults, whatever the notebook set: a model built
under ``torch.set_default_dtype(torch.float64)`` in the notebook came out float32 on the ranks,
and ``torch.manual_seed(0)`` before a launch did not seed them. A function called in the
notebook sees those settings, and so do ranks forked from the kernel itself (Accelerate's
``notebook_launcher``). What travels: the default dtype, the CPU generator's state (every rank
starts where the notebook's generator stands, as after a fork), deterministic-algorithms mode
and the float32 matmul precision. Nothing is read when the notebook has not imported torch.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["apply", "capture"]


def capture() -> dict[str, Any]:
    """The settings of this process's torch (none when torch is not imported here)."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "get_default_dtype"):
        return {}
    return {
        "default_dtype": str(torch.get_default_dtype()).removeprefix("torch."),
        "rng": torch.random.get_rng_state().numpy().tobytes(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "matmul_precision": torch.get_float32_matmul_precision(),
    }


def apply(state: dict[str, Any]) -> None:
    """Make this process's torch settings ``state`` (what :func:`capture` read)."""
    if not state:
        return
    import torch

    torch.set_default_dtype(getattr(torch, state["default_dtype"]))
    torch.random.set_rng_state(torch.frombuffer(bytearray(state["rng"]), dtype=torch.uint8))
    if state["deterministic"] or torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(
            state["deterministic"], warn_only=state["deterministic_warn_only"]
        )
    torch.set_float32_matmul_precision(state["matmul_precision"])
