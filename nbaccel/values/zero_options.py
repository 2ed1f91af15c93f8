"""The DeepSpeed launch options' values (``nbaccel launch --use_deepspeed ...``), checked before any
rank starts: a ZeRO stage, an offload device, a clipping norm, a true/false flag. Each check returns
the normalised value or raises ValueError naming the option and what it takes; None (not given)
passes through."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["OFFLOAD_DEVICES", "at_least", "offload_device", "yes_no", "zero_stage"]

OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def yes_no(text: Any) -> bool:
    """``true``/``false`` (1/0, yes/no) from a text front or a config file."""
    value = str(text).strip().lower()
    if value not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"expected true or false, got {text!r}.")
    return value in ("true", "1", "yes")


def optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``check``, letting None (not given) through."""
    return lambda value: None if value is None else check(value)


def zero_stage(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or value not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {value!r}.")
    return int(value)


def offload_device(name: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if value is None:
            return None
        if str(value).lower() not in OFFLOAD_DEVICES:
            raise ValueError(
                f"Unknown {name} {value!r}; choose one of {', '.join(OFFLOAD_DEVICES)}."
            )
        return str(value).lower()

    return check


def at_least(name: str, low: float) -> Callable[[Any], float | None]:
    def check(value: Any) -> float | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or value < low:
            raise ValueError(f"{name} must be a number >= {low}, got {value!r}.")
        return float(value)

    return check
