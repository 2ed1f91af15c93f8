"""Megatron-LM asked for: by the launch (its variables, checked up front) or the Accelerator.

``nbaccel launch --use_megatron_lm --megatron_lm_tp_degree 2 ...`` (or a config file's
``distributed_type: MEGATRON_LM`` with ``megatron_lm_config:``) becomes Accelerate's
``ACCELERATE_USE_MEGATRON_LM`` / ``MEGATRON_LM_*`` variables; :func:`megatron_check` builds the
plugin from them once before any rank starts, so a refused field or degrees that do not divide
the ranks fail there, and each rank's plain ``Accelerator()`` builds the same plugin
(:func:`requested`). :func:`attach` makes the run's state a ``MEGATRON_LM`` one.
"""

from __future__ import annotations

import os
from typing import Any

from nbaccel.distributed.state import DistributedType
from nbaccel.training.strategies.megatron.plugin import MegatronLMPlugin
from nbaccel.values.booleans import env_flag

__all__ = ["attach", "megatron_check", "requested"]


def requested(plugin: Any, other_engine: Any, partial_state: Any) -> MegatronLMPlugin | None:
    """The run's plugin: ``plugin``, else the launch's (``ACCELERATE_USE_MEGATRON_LM``) when no
    other engine was asked for; checked against the run's ranks before the shared state takes
    it."""
    flag = env_flag("ACCELERATE_USE_MEGATRON_LM")
    if plugin is None and other_engine is None and flag:
        plugin = MegatronLMPlugin()
    if plugin is not None:
        plugin.check_world(partial_state.num_processes)
    return plugin


def attach(state: Any, plugin: MegatronLMPlugin | None) -> None:
    """Make ``state`` a ``MEGATRON_LM`` run with ``plugin`` (Accelerate's
    ``accelerator.state.megatron_lm_plugin``); nothing when ``plugin`` is None."""
    if plugin is not None:
        state.megatron_lm_plugin, state.distributed_type = plugin, DistributedType.MEGATRON_LM


def megatron_check(env: dict[str, str], num_processes: int | None) -> dict[str, str]:
    """``env`` after building the plugin it describes (its errors raised here) and checking
    that ``tp_degree x pp_degree`` divides ``num_processes``."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("MEGATRON_LM_")}
    for key in saved:
        del os.environ[key]
    os.environ.update(env)
    try:
        plugin = MegatronLMPlugin()
    finally:
        for key in env:
            os.environ.pop(key, None)
        os.environ.update(saved)
    group = plugin.tp_degree * plugin.pp_degree
    if num_processes is not None and num_processes % group:
        raise ValueError(
            f"--megatron_lm_tp_degree {plugin.tp_degree} x --megatron_lm_pp_degree "
            f"{plugin.pp_degree} = {group} does not divide --num_processes {num_processes}: "
            f"launch a multiple of {group} processes, or change the degrees."
        )
    return env
