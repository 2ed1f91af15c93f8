"""The Megatron-LM launch options (Accelerate's ``--use_megatron_lm`` and ``--megatron_lm_*``
flags, its config file's ``megatron_lm_config:`` keys): how each is spelled, checked and parsed
(:func:`megatron_option`, used by ``LaunchRequest``'s fields), and what the ranks get from them
(:func:`megatron_environment`: ``ACCELERATE_USE_MEGATRON_LM`` and ``MEGATRON_LM_<NAME>``, which
each rank's ``MegatronLMPlugin`` reads).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from nbaccel.launch.options.accelerate_env import accelerate_environment
from nbaccel.launch.options.spec import Front, option
from nbaccel.values.booleans import parse_bool

__all__ = ["PREFIX", "megatron_environment", "megatron_option"]

#: the launch options' prefix (Accelerate's)
PREFIX = "megatron_lm_"


def _typed(kind: type, name: str) -> Callable[[Any], Any]:
    """A check: None, or a value of ``kind`` (bool from true/false words; int >= 0)."""

    def check(value: Any) -> Any:
        if value is None:
            return None
        if kind is bool:
            return parse_bool(value, name)
        try:
            number = kind(value)
        except (TypeError, ValueError):
            number = None
        if number is None or isinstance(value, bool) or number < 0:
            raise ValueError(f"{name} must be a non-negative {kind.__name__}, got {value!r}.")
        return number

    return check


def megatron_option(kind: type, what: str) -> Any:
    """A Megatron-LM launch option (Accelerate's ``--megatron_lm_*`` flag and config key):
    the ranks' ``MegatronLMPlugin`` reads it as ``MEGATRON_LM_<NAME>``."""
    parse = (lambda text: parse_bool(text, "a --megatron_lm_* flag")) if kind is bool else kind
    metavar = {bool: "BOOL", int: "N", float: "X", str: "WORD"}[kind]
    return option(None, f"Megatron-LM: {what}", Front.CLI, check=_typed(kind, what),
                  parse=parse, metavar=metavar)  # fmt: skip


def megatron_environment(given: Mapping[str, Any], use: bool) -> dict[str, str]:
    """The ranks' variables for the Megatron-LM options ``given`` (name -> value, set ones
    only); a ValueError naming them when given without ``use`` (never dropped quietly)."""
    if given and not use:
        raise ValueError(
            f"{', '.join(given)} configure a Megatron-LM run: add --use_megatron_lm (or "
            "distributed_type: MEGATRON_LM in the config file), or leave them out."
        )
    if not use:
        return {}
    return accelerate_environment({"use_megatron_lm": True, **given})
