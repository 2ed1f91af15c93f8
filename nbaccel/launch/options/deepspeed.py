"""Values of the DeepSpeed launch options (``nbaccel launch --use_deepspeed ...``): the offload
devices DeepSpeed has and true/false flags as the command line and config files write them."""

from __future__ import annotations

from typing import Any

from nbaccel.values.booleans import parse_bool

__all__ = ["OFFLOAD_DEVICES", "yes_no"]

OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def yes_no(text: Any) -> bool:
    """``true``/``false`` (1/0, yes/no, on/off...) from a text front or a config file."""
    return parse_bool(text)
