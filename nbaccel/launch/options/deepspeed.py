"""Values of the DeepSpeed launch options (``nbaccel launch --use_deepspeed ...``): the offload
devices DeepSpeed has and true/false flags as the command line and config files write them."""

from __future__ import annotations

from typing import Any

__all__ = ["OFFLOAD_DEVICES", "yes_no"]

OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def yes_no(text: Any) -> bool:
    """``true``/``false`` (1/0, yes/no) from a text front or a config file."""
    value = str(text).strip().lower()
    if value not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"expected true or false, got {text!r}.")
    return value in ("true", "1", "yes")
