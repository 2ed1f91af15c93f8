"""What ``Accelerator.prepare`` checks and marks on the way: unsupported requests refused with
the supported list, the run's parallel layout validated, models that cannot be trained refused,
prepared objects flagged as libraries expect; the run's precision chosen from every way it can be
asked for, and a model finished after its strategy prepared it."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from nbaccel.training.checkpointing.pretrained import gather_on_save_pretrained
from nbaccel.training.config.parallelism_config import ParallelismConfig
from nbaccel.training.precision.policy import PrecisionPolicy
from nbaccel.training.precision.select import select_precision
from nbaccel.training.step.compilation import describe_run
from nbaccel.training.strategies.repoint import remember_moves
from nbaccel.values.booleans import env_flag

__all__ = [
    "check_parallelism",
    "choose_precision",
    "finish_model",
    "has_device_map",
    "mark_prepared",
    "refuse_offloaded_quantized",
    "unsupported",
]


def unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"{what} is not supported by nbaccel. Supported: DDP (multi-CPU/GPU/XPU), FSDP2 "
        "(fsdp_plugin=FullyShardedDataParallelPlugin(...)), DeepSpeed ZeRO (deepspeed_plugin="
        "DeepSpeedPlugin(...)), tensor/hybrid/context parallel "
        "(parallelism_config=ParallelismConfig(...)), tensor + pipeline parallel "
        "(megatron_lm_plugin=MegatronLMPlugin(...)), torch-xla, and mixed precision "
        "'no', 'fp16', 'bf16' or 'fp8'."
    )


def mark_prepared(obj: Any) -> Any:
    """Flag an object ``prepare`` returned (``_is_nbaccel_prepared``; also Accelerate's
    ``_is_accelerate_prepared``, which libraries such as transformers' Trainer look for)."""
    for flag in ("_is_nbaccel_prepared", "_is_accelerate_prepared"):
        with contextlib.suppress(AttributeError, TypeError):
            setattr(obj, flag, True)
    return obj


def check_parallelism(config: Any, accelerator: Any, tp_plugin: Any = None) -> Any:
    """The run's layout, validated against it: the one passed, else the launcher's
    (``PARALLELISM_CONFIG_*``), with a ``torch_tp_plugin``'s tp_size (Accelerate's older
    spelling). Tensor/context parallel and HSDP train on the mesh strategy."""
    if config is None and env_flag("ACCELERATE_USE_PARALLELISM_CONFIG"):
        config = ParallelismConfig()  # sizes from PARALLELISM_CONFIG_* (nbaccel launch)
    if tp_plugin is not None:
        config = ParallelismConfig.from_tp_plugin(tp_plugin, accelerator.num_processes, config)
    if config is None:
        return None
    if not isinstance(config, ParallelismConfig):
        raise TypeError(f"parallelism_config must be a ParallelismConfig, not {type(config)}.")
    config._validate_accelerator(accelerator)
    return config


def has_device_map(model: torch.nn.Module) -> bool:
    device_map = getattr(model, "hf_device_map", None)
    return isinstance(device_map, dict) and len(set(device_map.values())) > 1


def refuse_offloaded_quantized(model: torch.nn.Module) -> None:
    """A model loaded in 8/4-bit whose device map puts layers on cpu/disk cannot be trained."""
    quantized = getattr(model, "is_loaded_in_8bit", False) or getattr(
        model, "is_loaded_in_4bit", False
    )
    device_map = getattr(model, "hf_device_map", None)
    if quantized and isinstance(device_map, dict):
        offloaded = sorted({str(d) for d in device_map.values()} & {"cpu", "disk"})
        if offloaded:
            raise ValueError(
                f"This model is quantized (8/4-bit) and its device map uses CPU or disk offload "
                f"({', '.join(offloaded)}): such a model cannot be trained. Load it with a "
                "device_map that keeps every layer on the accelerator."
            )


def choose_precision(state: Any, handlers: dict[type, Any]) -> PrecisionPolicy:
    """The run's precision policy: ``mixed_precision``, an FP8 recipe handler or an FSDP plugin
    set to ``"fp8"`` (applied, or refused naming the fix)."""
    kind = getattr(state.distributed_type, "value", None)
    return select_precision(
        state.mixed_precision,
        state.device.type,
        handlers,
        engine=kind if kind in ("FSDP", "DEEPSPEED") else None,
        plugin_fp8=bool(getattr(state.fsdp_plugin, "fp8_requested", False)),
    )


def finish_model(
    accelerator: Any, model: torch.nn.Module, before: dict[str, torch.nn.Parameter]
) -> torch.nn.Module:
    """``model`` after its strategy prepared it (``before``: its parameters before): optimizers
    built earlier follow the parameters that FP8 layers and sharding replaced (torchao's fsdp
    float8 all-gather wraps each weight in a new Parameter; matched by name), a sharded model's
    ``save_pretrained`` gathers, the model is compiled as asked, and the main process says what
    it runs with when that is FP8 or compiled."""
    strategy, compilation = accelerator.strategy, accelerator.compilation
    inner = strategy.unwrap_parallel(model)
    remember_moves(model, before, dict(inner.named_parameters(remove_duplicate=False)))
    if strategy.shards_weights:
        gather_on_save_pretrained(model, accelerator.get_state_dict, accelerator.is_main_process)
    model = compilation.apply(model, sharded=strategy.shards_weights)
    if accelerator.is_main_process and (accelerator.fp8_enabled or compilation.enabled):
        summary = describe_run(accelerator.precision, model, compilation)
        print(f"nbaccel: model prepared: {summary}")
    return model
