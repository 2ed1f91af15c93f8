"""Megatron-LM asked for from outside the script: the launch's variables, checked up front.

``nbaccel launch --use_megatron_lm --megatron_lm_tp_degree 2 ...`` (or a config file's
``distributed_type: MEGATRON_LM`` with ``megatron_lm_config:``) becomes Accelerate's
``ACCELERATE_USE_MEGATRON_LM`` / ``MEGATRON_LM_*`` variables; :func:`megatron_check` builds the
plugin from them once before any rank starts, so a refused field or degrees that do not divide
the ranks fail there, and each rank's plain ``Accelerator()`` builds the same plugin.
"""

from __future__ import annotations

import os

from nbaccel.training.strategies.model_parallel.megatron_plugin import MegatronLMPlugin

__all__ = ["megatron_check"]


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
