"""DeepSpeed asked for from outside the script: launch options -> rank environment -> plugin.

``nbaccel launch --use_deepspeed --zero_stage 3 ...`` (or a config file's ``deepspeed_config``)
becomes Accelerate's ``ACCELERATE_USE_DEEPSPEED`` / ``ACCELERATE_DEEPSPEED_*`` variables for the
ranks (:func:`deepspeed_environment`, checked before any rank starts); a plain ``Accelerator()``
on a rank then builds its ``DeepSpeedPlugin`` from them (:func:`plugin_from_environment`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from nbaccel.values.booleans import env_flag

__all__ = [
    "deepspeed_environment",
    "plugin_from_environment",
    "prepare_deepspeed_cmd_env",
    "requested_plugins",
]

#: launch option -> the rank variable it becomes
_VARIABLES = {
    "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "offload_optimizer_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
    "offload_param_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
    "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
    "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
    "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    "deepspeed_moe_layer_cls_names": "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES",
}


def _on(name: str) -> bool:
    return bool(env_flag(name))


def plugin_from_environment() -> Any:
    """The ``DeepSpeedPlugin`` a launch asked for through the environment, or None."""
    if not (_on("ACCELERATE_USE_DEEPSPEED") or _on("NBACCEL_USE_DEEPSPEED")):
        return None
    from nbaccel.training.strategies.deepspeed.plugin import DeepSpeedPlugin

    return DeepSpeedPlugin()


def requested_plugins(single: Any, several: Any, fsdp_plugin: Any) -> Any:
    """The DeepSpeed plugin(s) an ``Accelerator`` was asked for: ``deepspeed_plugin``,
    ``deepspeed_plugins``, or the launch's (environment); None when none."""
    if single is not None and several is not None:
        raise ValueError("Pass deepspeed_plugin or deepspeed_plugins, not both.")
    plugins = single if single is not None else several
    if plugins is None and fsdp_plugin is None:
        plugins = plugin_from_environment()
    if plugins is None:
        return None
    if fsdp_plugin is not None:
        raise ValueError("Pass either a DeepSpeed plugin or an FSDP plugin, not both.")
    from nbaccel.training.strategies.deepspeed.plugin import DeepSpeedPlugin

    for plugin in plugins.values() if isinstance(plugins, dict) else [plugins]:
        if not isinstance(plugin, DeepSpeedPlugin):
            raise TypeError(f"deepspeed_plugin(s) must be DeepSpeedPlugin objects, not {plugin!r}.")
    from nbaccel.training.strategies.deepspeed.runtime import (
        deepspeed_missing,
        is_deepspeed_available,
    )

    if not is_deepspeed_available():
        raise deepspeed_missing("Accelerator(deepspeed_plugin=...)")
    return plugins


def deepspeed_environment(options: Any, num_processes: int | None = None) -> dict[str, str]:
    """The rank variables for a DeepSpeed launch described by ``options`` (an argparse
    namespace); the plugin they describe is built once here, so a bad config (a contradiction,
    a missing file, an offload device that does not exist) fails before any rank starts."""
    env = {"ACCELERATE_USE_DEEPSPEED": "true"}
    for name, variable in _VARIABLES.items():
        value = getattr(options, name, None)
        if value is not None and str(value).lower() != "none":
            env[variable] = str(value).lower() if isinstance(value, bool) else str(value)
    config = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if config is not None:
        if not os.path.isfile(config):
            raise ValueError(f"--deepspeed_config_file {config!r}: no such file.")
        env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = os.path.abspath(config)
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        from nbaccel.training.strategies.deepspeed.config import check_config
        from nbaccel.training.strategies.deepspeed.plugin import DeepSpeedPlugin

        plugin = DeepSpeedPlugin()
        plugin.set_mixed_precision(str(getattr(options, "mixed_precision", None) or "no"))
        check_config(plugin.deepspeed_config, num_processes)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return env


def prepare_deepspeed_cmd_env(args: Any) -> tuple[list[str], dict[str, str]]:
    """``(command, environment)`` that runs ``args.training_script`` under DeepSpeed with nbaccel's
    launcher (``nbaccel launch --use_deepspeed``): Accelerate's helper, for code that calls it."""
    env = dict(os.environ)
    env.update(deepspeed_environment(args, getattr(args, "num_processes", None)))
    cmd = [sys.executable, "-m", "nbaccel.commands.launch", "--use_deepspeed"]
    if getattr(args, "num_processes", None):
        cmd += ["--num_processes", str(args.num_processes)]
    cmd += [args.training_script, *getattr(args, "training_script_args", [])]
    return cmd, env
