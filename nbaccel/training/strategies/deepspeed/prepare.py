"""Turning what ``prepare`` was given into the arguments of ``deepspeed.initialize``.

DeepSpeed builds one engine from a model, its optimizer and its scheduler together, from a
config whose ``"auto"`` values come from what ``prepare`` sees: the micro batch from the
dataloaders, gradient accumulation from the Accelerator, optimizer and scheduler parameters from
``DummyOptim`` / ``DummyScheduler``, bucket sizes from ``model.config.hidden_size``. Everything
that contradicts (two batch sizes, two accumulation counts, an optimizer in the config and in the
code, a model that was already wrapped or moved away) is refused here, before the engine starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from nbaccel.training.strategies.deepspeed.config import AUTO, check_config, fill_auto, unfilled
from nbaccel.training.strategies.deepspeed.plugin import DeepSpeedPlugin
from nbaccel.training.strategies.deepspeed.wrappers import DummyOptim, DummyScheduler

__all__ = ["EngineRequest", "engine_request", "split_prepare_args"]


@dataclass
class EngineRequest:
    """What one ``deepspeed.initialize`` call is given (``kwargs``) and where its results go."""

    kwargs: dict[str, Any]
    model_index: int
    optimizer_index: int | None
    scheduler_index: int | None


def _is_scheduler(obj: Any, deepspeed: Any) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler | DummyScheduler) or (
        type(obj).__name__ in deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES
    )


def split_prepare_args(args: list[Any], deepspeed: Any) -> tuple[list, list, list]:
    """``(models, optimizers, schedulers)`` of ``args`` as ``(index, object)`` pairs; more than
    one of a kind is refused (one engine per ``prepare`` call)."""
    from nbaccel.training.step.optimizer import AcceleratedOptimizer

    models = [(i, a) for i, a in enumerate(args) if isinstance(a, nn.Module)]
    optimizers = [
        (i, a)
        for i, a in enumerate(args)
        if isinstance(a, torch.optim.Optimizer | DummyOptim)
        and not isinstance(a, AcceleratedOptimizer)
    ]
    schedulers = [(i, a) for i, a in enumerate(args) if _is_scheduler(a, deepspeed)]
    for kind, found in (("model", models), ("optimizer", optimizers), ("scheduler", schedulers)):
        if len(found) > 1:
            raise ValueError(
                f"prepare got {len(found)} {kind}s: under DeepSpeed each prepare call builds one "
                f"engine from one model (with its optimizer and scheduler). Prepare the others in "
                "their own calls, with their own plugin (accelerator.state."
                "select_deepspeed_plugin(name)) or a second Accelerator."
            )
    if not models and (optimizers or schedulers):
        raise ValueError(
            "Under DeepSpeed the optimizer and scheduler are prepared with their model: pass "
            "them in one call, accelerator.prepare(model, optimizer, scheduler, ...)."
        )
    return models, optimizers, schedulers


def check_model(model: nn.Module, device: torch.device, stage: int) -> None:
    """Refuse a model DeepSpeed cannot take as it is: already wrapped by a parallel engine, on
    the meta device, or moved to a device other than this rank's."""
    wrapped = type(model).__name__
    if wrapped in ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine") or hasattr(
        model, "_fsdp_param_group"
    ):
        raise ValueError(
            f"This model is already wrapped ({wrapped}): DeepSpeed must get the plain module. "
            "Pass the model before any DDP/FSDP/DeepSpeed wrapping (accelerator.unwrap_model)."
        )
    devices = {p.device for p in model.parameters() if not hasattr(p, "ds_id")}
    if any(d.type == "meta" for d in devices):
        raise ValueError(
            "This model has parameters on the meta device: DeepSpeed needs real weights. Load "
            "them first, or build the model under zero3_init_flag=True (ZeRO-3 builds it "
            "partitioned)."
        )
    moved = sorted(str(d) for d in devices if d.type != "cpu" and d != device)
    if moved:
        raise ValueError(
            f"This model was moved to {', '.join(moved)}, but this rank runs on {device}"
            f"{' and ZeRO-3 partitions it from there' if stage == 3 else ''}: leave the model "
            f"on the CPU (or on {device}) and let prepare place it."
        )


def _micro_batch(plugin: DeepSpeedPlugin, loaders: list[DataLoader], state: Any) -> int | None:
    sizes = [loader.batch_size for loader in loaders if loader.batch_size is not None]
    if state.split_batches:
        sizes = [size // state.num_processes for size in sizes]
    configured = plugin.get_value("train_micro_batch_size_per_gpu", AUTO)
    if configured != AUTO:
        if sizes and configured not in sizes:
            raise ValueError(
                f"Two batch sizes: the DeepSpeed config says train_micro_batch_size_per_gpu="
                f"{configured}, the dataloader gives {sorted(set(sizes))} per process. Set "
                "train_micro_batch_size_per_gpu to 'auto', or make the dataloader's batch_size "
                "match."
            )
        return configured
    if not sizes:
        if loaders:
            raise ValueError(
                "A dataloader passed to prepare has batch_size=None: set an integer "
                "train_micro_batch_size_per_gpu in the DeepSpeed config."
            )
        return None
    return min(sizes) if plugin.is_train_batch_min else max(sizes)


def _settle_accumulation(plugin: DeepSpeedPlugin, state: Any) -> int:
    configured = plugin.get_value("gradient_accumulation_steps", AUTO)
    ours = state.gradient_accumulation_steps
    if configured == AUTO:
        plugin.deepspeed_config["gradient_accumulation_steps"] = ours
        return ours
    if configured != ours:
        if ours != 1:
            raise ValueError(
                f"Two gradient accumulation counts: the DeepSpeed config says "
                f"gradient_accumulation_steps={configured}, the Accelerator "
                f"gradient_accumulation_steps={ours}. Set one of them to 'auto' / leave it out."
            )
        state.gradient_accumulation_steps = configured
    return configured


def _hidden_size_values(plugin: DeepSpeedPlugin, model: nn.Module) -> dict[str, int]:
    keys = [
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
    ]
    wanted = [k for k in keys if plugin.is_auto(k)]
    if not wanted:
        return {}
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None)
    if hidden is None and getattr(config, "hidden_sizes", None):
        hidden = max(config.hidden_sizes)
    if hidden is None:
        raise ValueError(
            f"The DeepSpeed config has {wanted} set to 'auto', filled from model.config."
            "hidden_size, which this model does not have: replace 'auto' with numbers."
        )
    return dict(zip(keys, (hidden * hidden, int(0.9 * hidden * hidden), 10 * hidden)))


def _check_optimizer_sources(config: dict, optimizer: Any, scheduler: Any) -> None:
    if optimizer is not None:
        if "optimizer" in config and not isinstance(optimizer, DummyOptim):
            raise ValueError(
                "Two optimizers: the DeepSpeed config has an 'optimizer' section and the code "
                "passes a torch optimizer. Remove the section, or pass DummyOptim(params) instead."
            )
        if "optimizer" not in config and isinstance(optimizer, DummyOptim):
            raise ValueError(
                "DummyOptim stands for the config's optimizer, and the DeepSpeed config has no "
                "'optimizer' section: add one, or pass a torch optimizer."
            )
    if scheduler is not None:
        if "scheduler" in config and not isinstance(scheduler, DummyScheduler):
            raise ValueError(
                "Two schedulers: the DeepSpeed config has a 'scheduler' section and the code "
                "passes a scheduler. Remove the section, or pass DummyScheduler(optimizer)."
            )
        if (
            isinstance(scheduler, DummyScheduler)
            and "scheduler" not in config
            and scheduler.lr_scheduler_callable is None
        ):
            raise ValueError(
                "DummyScheduler needs a 'scheduler' section in the DeepSpeed config or an "
                "lr_scheduler_callable."
            )
        if isinstance(optimizer, DummyOptim) and not isinstance(scheduler, DummyScheduler):
            raise ValueError("With DummyOptim, pass DummyScheduler as the scheduler.")


def engine_request(
    plugin: DeepSpeedPlugin,
    run: Any,
    args: list[Any],
    models: list,
    optimizers: list,
    schedulers: list,
    deepspeed: Any,
) -> EngineRequest:
    """Fill the plugin's config from ``args`` and check it; the ``deepspeed.initialize``
    arguments for its one model. ``run`` answers ``num_processes``, ``split_batches``,
    ``gradient_accumulation_steps`` (settable) and ``device``."""
    (model_index, model) = models[0]
    optimizer_index, optimizer = optimizers[0] if optimizers else (None, None)
    scheduler_index, scheduler = schedulers[0] if schedulers else (None, None)
    config = plugin.deepspeed_config
    check_model(model, run.device, plugin.zero_stage)
    _check_optimizer_sources(config, optimizer, scheduler)
    loaders = [a for a in args if isinstance(a, DataLoader)]
    micro = _micro_batch(plugin, loaders, run)
    steps = _settle_accumulation(plugin, run)
    if micro is not None:  # batch keys the config left out are added
        batch = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": steps}
        batch["train_batch_size"] = micro * steps * run.num_processes
        fill_auto(config, batch, add=True)
    values: dict[str, Any] = {"gradient_clipping": 1.0}
    values["zero_optimization.stage3_gather_16bit_weights_on_model_save"] = False
    values.update(_hidden_size_values(plugin, model))
    if isinstance(optimizer, DummyOptim):
        values["optimizer.params.lr"] = optimizer.lr
        values["optimizer.params.weight_decay"] = optimizer.weight_decay
    if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is None:
        values["scheduler.params.warmup_min_lr"] = 0
        values["scheduler.params.warmup_max_lr"] = getattr(optimizer, "lr", None)
        values["scheduler.params.warmup_num_steps"] = max(1, scheduler.warmup_num_steps)
        if scheduler.total_num_steps is not None:
            total = scheduler.total_num_steps
            values["scheduler.params.total_num_steps"] = (
                total if run.split_batches else math.ceil(total / run.num_processes)
            )
    fill_auto(config, values)
    plugin.hf_ds_config.set_stage_and_offload()
    check_config(config, run.num_processes)
    left = [k for k in unfilled(config) if not k.startswith("zero_optimization.stage3_max")]
    if left:
        raise ValueError(
            f"These DeepSpeed config values are 'auto' and nothing in prepare fills them: "
            f"{', '.join(left)}. Replace them with numbers."
        )
    for key in unfilled(config):
        plugin.hf_ds_config.del_config_sub_tree(key)
    kwargs: dict[str, Any] = {"model": model, "config_params": config}
    if isinstance(optimizer, DummyOptim):
        kwargs["model_parameters"] = optimizer.params
        if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is not None:
            kwargs["lr_scheduler"] = scheduler.lr_scheduler_callable
    elif optimizer is not None:
        config.setdefault("zero_allow_untested_optimizer", True)
        offload = plugin.get_value("zero_optimization.offload_optimizer.device", "none")
        if str(offload) != "none" and config.get("zero_force_ds_cpu_optimizer", True):
            from nbaccel.training.strategies.deepspeed.wrappers import (
                map_pytorch_optim_to_deepspeed,
            )

            optimizer = map_pytorch_optim_to_deepspeed(optimizer)
        kwargs["optimizer"] = optimizer
        if scheduler is not None and _is_deepspeed_scheduler(scheduler, deepspeed):
            kwargs["lr_scheduler"] = scheduler
    return EngineRequest(kwargs, model_index, optimizer_index, scheduler_index)


def _is_deepspeed_scheduler(scheduler: Any, deepspeed: Any) -> bool:
    return type(scheduler).__name__ in deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES
