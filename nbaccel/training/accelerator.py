"""``Accelerator``: the training API users call, as a thin orchestrator over nbaccel's modules.

Who runs where: :mod:`nbaccel.distributed.state`. Mixed precision:
:mod:`nbaccel.training.precision`. Everything that depends on the kind of parallelism (model
wrapping, clipping, optimizer step, state dicts, sharded checkpoints): the ``Strategy`` chosen
once in ``__init__`` (:mod:`nbaccel.training.strategies`).
Optimizer / scheduler wrappers: :mod:`nbaccel.training.optimizer`,
:mod:`nbaccel.training.scheduler`. Data sharding: :mod:`nbaccel.data`. Checkpoints:
:mod:`nbaccel.training.checkpoint`, :mod:`nbaccel.storage.weights`. Trackers:
:mod:`nbaccel.training.trackers`.
This class keeps the prepared objects and the accumulation step counter, and routes calls.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from nbaccel.data import DataLoaderDispatcher, DataLoaderShard, prepare_data_loader
from nbaccel.distributed.state import AcceleratorState, GradientState
from nbaccel.training.accelerator_control import ProcessControlMixin
from nbaccel.training.accelerator_io import StateIOMixin
from nbaccel.training.accelerator_names import AcceleratorNamesMixin
from nbaccel.training.configuration import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    ProjectConfiguration,
)
from nbaccel.training.kwargs_handlers import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
)
from nbaccel.training.optimizer import AcceleratedOptimizer
from nbaccel.training.parallelism_config import ParallelismConfig
from nbaccel.training.precision import PrecisionPolicy
from nbaccel.training.scheduler import AcceleratedScheduler
from nbaccel.training.strategies.deepspeed_launch import requested_plugins
from nbaccel.training.strategies.fsdp_plugin import FullyShardedDataParallelPlugin
from nbaccel.training.strategies.registry import select_strategy
from nbaccel.training.trackers import TrackerSet
from nbaccel.values.booleans import env_flag

__all__ = ["Accelerator"]

_HANDLERS = (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
)


def _refuse(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"{what} is not supported by nbaccel. Supported: DDP (multi-CPU/GPU/XPU), FSDP2 "
        "(fsdp_plugin=FullyShardedDataParallelPlugin(...)), DeepSpeed ZeRO (deepspeed_plugin="
        "DeepSpeedPlugin(...)), tensor/hybrid/context parallel "
        "(parallelism_config=ParallelismConfig(...)), tensor + pipeline parallel "
        "(megatron_lm_plugin=MegatronLMPlugin(...)), torch-xla, and mixed precision "
        "'no', 'fp16' or 'bf16'."
    )


def _mark_prepared(obj: Any) -> Any:
    """Flag an object ``prepare`` returned (``_is_nbaccel_prepared``; also Accelerate's
    ``_is_accelerate_prepared``, which libraries such as transformers' Trainer look for)."""
    for flag in ("_is_nbaccel_prepared", "_is_accelerate_prepared"):
        with contextlib.suppress(AttributeError, TypeError):
            setattr(obj, flag, True)
    return obj


def _check_parallelism(config: Any, accelerator: Any, tp_plugin: Any = None) -> Any:
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


class Accelerator(ProcessControlMixin, StateIOMixin, AcceleratorNamesMixin):
    """Distributed training, mixed precision and checkpointing with Accelerate's public API.

    Create one per training run (every process runs the same code), ``prepare`` the model(s),
    optimizer(s), dataloader(s) and scheduler(s), and replace ``loss.backward()`` with
    ``accelerator.backward(loss)``. See the module docstring for where each part lives.
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool = False,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        rng_types: list[str] | None = None,
        log_with: Any = None,
        project_dir: str | os.PathLike | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list[KwargsHandler] | None = None,
        dynamo_backend: str | None = None,
        dynamo_plugin: Any = None,
        deepspeed_plugins: Any = None,
        parallelism_config: Any = None,
    ) -> None:
        deepspeed_plugin = requested_plugins(deepspeed_plugin, deepspeed_plugins, fsdp_plugin)
        mixed_precision = str(getattr(mixed_precision, "value", mixed_precision) or "") or None
        if (mixed_precision or os.environ.get("NBACCEL_MIXED_PRECISION", "")).lower() == "fp8":
            raise _refuse("mixed_precision='fp8'")
        self.handlers = self._sort_handlers(kwargs_handlers or [])
        group = self.handlers.get(InitProcessGroupKwargs)
        group_options = {} if group is None else group.to_kwargs()
        group_options.pop("init_method", None)
        if fsdp_plugin is None and deepspeed_plugin is None:
            fsdp_plugin = FullyShardedDataParallelPlugin.from_environment()  # launch --use_fsdp
        self.state = AcceleratorState(
            mixed_precision=mixed_precision,
            cpu=cpu,
            dynamo_plugin=dynamo_plugin,
            fsdp_plugin=fsdp_plugin,
            deepspeed_plugin=deepspeed_plugin,
            _from_accelerator=True,
            **group_options,
        )
        self.parallelism_config = _check_parallelism(parallelism_config, self, torch_tp_plugin)
        self.project_configuration = project_config or ProjectConfiguration()
        if project_dir is not None:
            self.project_configuration.set_directories(project_dir)
        env_steps = os.environ.get("NBACCEL_GRADIENT_ACCUMULATION_STEPS")
        if gradient_accumulation_plugin is None:
            steps = gradient_accumulation_steps
            if steps == 1 and env_steps:
                steps = int(env_steps)
            gradient_accumulation_plugin = GradientAccumulationPlugin(num_steps=steps)
        elif gradient_accumulation_steps != 1:
            raise ValueError(
                "Pass either gradient_accumulation_steps or gradient_accumulation_plugin, not "
                "both (set num_steps on the plugin)."
            )
        self.gradient_state = GradientState(gradient_accumulation_plugin)
        self.dataloader_config = dataloader_config or DataLoaderConfiguration()
        if split_batches:
            self.dataloader_config.split_batches = True
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.rng_types = list(rng_types) if rng_types is not None else ["generator"]
        self.dynamo_backend = dynamo_backend or os.environ.get("NBACCEL_DYNAMO_BACKEND")
        self.dynamo_plugin = dynamo_plugin
        self.precision = PrecisionPolicy(
            self.state.mixed_precision,
            self.device.type,
            self.handlers.get(AutocastKwargs),
            self.handlers.get(GradScalerKwargs),
        )
        self.strategy = select_strategy(
            self.state,
            self.precision,
            self.handlers.get(DistributedDataParallelKwargs),
            parallelism_config=self.parallelism_config,
            tp_plan=getattr(torch_tp_plugin, "tp_plan", None),
            megatron_lm_plugin=megatron_lm_plugin,
        )
        self.scaler = None if self.strategy.owns_precision else self.precision.scaler
        self.profile_handler = self.handlers.get(ProfileKwargs)
        self.step = 0
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[DataLoader] = []
        self._custom_objects: list[Any] = []
        self._save_model_state_pre_hook: OrderedDict[int, Callable] = OrderedDict()
        self._load_model_state_pre_hook: OrderedDict[int, Callable] = OrderedDict()
        self._trackers = TrackerSet(log_with, self.logging_dir, self.is_main_process)
        self.flag_tensor: torch.Tensor | None = None

    @staticmethod
    def _sort_handlers(handlers: list[KwargsHandler]) -> dict[type, KwargsHandler]:
        found: dict[type, KwargsHandler] = {}
        for handler in handlers:
            kind = next((k for k in _HANDLERS if isinstance(handler, k)), None)
            if kind is None:
                raise TypeError(
                    f"Unsupported kwargs handler {type(handler).__name__}; nbaccel takes "
                    f"{[k.__name__ for k in _HANDLERS]}."
                )
            if kind in found:
                raise ValueError(f"Only one {kind.__name__} may be passed in kwargs_handlers.")
            found[kind] = handler
        return found

    # -- who and where ------------------------------------------------------------------------
    device = property(lambda self: self.state.device)
    distributed_type = property(lambda self: self.state.distributed_type)
    num_processes = property(lambda self: self.state.num_processes)
    process_index = property(lambda self: self.state.process_index)
    local_process_index = property(lambda self: self.state.local_process_index)
    is_main_process = property(lambda self: self.state.is_main_process)
    is_local_main_process = property(lambda self: self.state.is_local_main_process)
    is_last_process = property(lambda self: self.state.is_last_process)
    use_distributed = property(lambda self: self.state.use_distributed)
    mixed_precision = property(lambda self: self.state.mixed_precision)
    split_batches = property(lambda self: self.dataloader_config.split_batches)
    dispatch_batches = property(lambda self: self.dataloader_config.dispatch_batches)
    use_seedable_sampler = property(lambda self: self.dataloader_config.use_seedable_sampler)
    non_blocking = property(lambda self: self.dataloader_config.non_blocking)
    project_dir = property(lambda self: self.project_configuration.project_dir)
    logging_dir = property(lambda self: self.project_configuration.logging_dir)
    save_iteration = property(lambda self: self.project_configuration.iteration)
    trackers = property(lambda self: self._trackers.trackers)

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state._set_sync_gradients(value)

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        self.gradient_state.plugin_kwargs.update({"num_steps": int(value)})

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (fp16 overflow): hold the schedule."""
        return any(opt.step_was_skipped for opt in self._optimizers)

    # -- prepare ------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepare models, optimizers, dataloaders and schedulers (any order); same order out."""
        placement = list(device_placement) if device_placement else [None] * len(args)
        if len(placement) != len(args):
            raise ValueError(
                f"device_placement has {len(placement)} entries for {len(args)} objects."
            )
        if self.strategy.prepares_together:  # DeepSpeed: one engine from model + optimizer
            result = self.strategy.prepare_together(
                list(args), self, self.prepare_data_loader, self._register_prepared
            )
            return result[0] if len(result) == 1 else tuple(result)
        result = list(args)
        kinds = (
            (torch.nn.Module, self.prepare_model),
            (torch.optim.Optimizer, self.prepare_optimizer),
            (DataLoader, self.prepare_data_loader),
            (torch.optim.lr_scheduler.LRScheduler, lambda s, p: self.prepare_scheduler(s)),
        )
        for kind, prepare_one in kinds:  # models first: FSDP may replace their parameters
            for i, obj in enumerate(args):
                if isinstance(obj, kind) and not isinstance(obj, AcceleratedScheduler):
                    result[i] = _mark_prepared(prepare_one(obj, placement[i]))
        return result[0] if len(result) == 1 else tuple(result)

    def prepare_model(
        self,
        model: torch.nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> torch.nn.Module:
        """Place ``model``, add autocast, wrap it for DDP/FSDP, compile it if asked.
        A model this accelerator already prepared is returned as it is."""
        if any(m is model for m in self._models):
            return model
        if self.strategy.prepares_together:
            return self.prepare(model)
        _refuse_offloaded_quantized(model)
        if device_placement is None:
            device_placement = self.device_placement
        place = device_placement and not _has_device_map(model)
        model = self.strategy.prepare_model(model, place, evaluation_mode)
        backend = self.dynamo_backend
        if backend and str(backend).lower() != "no":
            options = _dynamo_options(self.dynamo_plugin)
            model = torch.compile(model, backend=str(backend).lower(), **options)
        self._models.append(_mark_prepared(model))
        for optimizer in self._optimizers:  # prepared before this model: follow its parameters
            self.strategy.prepare_optimizer(optimizer, [model])
        return model

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> AcceleratedOptimizer:
        """Wrap ``optimizer`` for accumulation and loss scaling."""
        if isinstance(optimizer, AcceleratedOptimizer):
            return optimizer
        placement = self.device_placement if device_placement is None else device_placement
        self.strategy.prepare_optimizer(optimizer, self._models)  # built before prepare(model)?
        wrapped = AcceleratedOptimizer(
            optimizer, placement, self.scaler, step_fn=self.strategy.optimizer_step
        )
        self._optimizers.append(_mark_prepared(wrapped))
        return wrapped

    def prepare_data_loader(
        self,
        data_loader: DataLoader,
        device_placement: bool | None = None,
        slice_fn_for_dispatch: Callable | None = None,
    ) -> DataLoader:
        """Shard ``data_loader`` across processes (see :mod:`nbaccel.data`)."""
        if isinstance(data_loader, DataLoaderShard | DataLoaderDispatcher):
            if data_loader not in self._dataloaders:
                self._dataloaders.append(data_loader)
            return data_loader
        config = self.dataloader_config
        prepared = prepare_data_loader(
            data_loader,
            self.device,
            num_processes=self.strategy.data_parallel_size,  # None: every rank
            process_index=self.strategy.data_parallel_rank,
            split_batches=config.split_batches,
            put_on_device=self.device_placement if device_placement is None else device_placement,
            rng_types=list(self.rng_types),
            dispatch_batches=config.dispatch_batches,
            even_batches=config.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=config.use_seedable_sampler,
            data_seed=config.data_seed,
            non_blocking=config.non_blocking,
            use_stateful_dataloader=config.use_stateful_dataloader,
        )
        prepared = _mark_prepared(self.strategy.prepare_dataloader(prepared))
        self._dataloaders.append(prepared)
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Wrap ``scheduler`` so it steps with its prepared optimizer(s)."""
        target = getattr(scheduler, "optimizer", None)
        followed = [o for o in self._optimizers if o is target or o.optimizer is target]
        wrapped = AcceleratedScheduler(
            scheduler,
            followed or [target],
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.split_batches,
        )
        self._schedulers.append(_mark_prepared(wrapped))
        return wrapped

    def _register_prepared(self, kind: str, obj: Any) -> None:
        """Record an object a strategy prepared itself (``prepares_together``)."""
        {"model": self._models, "optimizer": self._optimizers, "scheduler": self._schedulers}[
            kind
        ].append(_mark_prepared(obj))

    def verify_device_map(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` was dispatched over several devices (big-model inference)."""
        return _has_device_map(model)

    # -- the training step --------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided for accumulation and scaled under fp16."""
        steps = self.gradient_state.num_steps
        if steps > 1 and not self.strategy.engine_scales_accumulation:
            loss = loss / steps
        self.strategy.backward(loss, **kwargs)

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """One batch of gradient accumulation: no gradient sync until the step that applies."""
        state = self.gradient_state
        if state.sync_with_dataloader and state.end_of_dataloader:
            self.step = 0
            state._set_sync_gradients(True)
        else:
            self.step += 1
            state._set_sync_gradients(self.step % state.num_steps == 0)
        allow_sync = state.sync_gradients or state.plugin_kwargs.get("sync_each_batch", False)
        with contextlib.ExitStack() as stack:
            if not allow_sync:
                for model in models:
                    stack.enter_context(self.strategy.no_sync(model))
            yield

    def no_sync(self, model: torch.nn.Module) -> Any:
        """Backward passes inside do not synchronise ``model``'s gradients (DDP/FSDP)."""
        return self.strategy.no_sync(model)

    def trigger_sync_in_backward(self, model: torch.nn.Module) -> Any:
        """Make the next backward synchronise even though its forward ran under ``no_sync``."""
        return self.strategy.trigger_sync(model)

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list[Any], even_batches: bool | None = None):
        """Let DDP processes with different numbers of batches finish together (torch Join)."""
        if not self.strategy.joins_uneven_inputs:
            yield
            return
        from torch.distributed.algorithms.join import Join

        saved = []
        if even_batches is not None:
            for loader in self._dataloaders:
                sampler = getattr(loader, "batch_sampler", None)
                if hasattr(sampler, "even_batches"):
                    saved.append((loader, sampler, sampler.even_batches, loader.remainder))
                    sampler.even_batches = even_batches
                    loader.remainder = loader.remainder if even_batches else -1
        try:
            with Join(joinables):
                yield
        finally:
            for loader, sampler, even, remainder in saved:
                sampler.even_batches, loader.remainder = even, remainder

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> Any:
        """The mixed-precision autocast context (a null context without mixed precision)."""
        return self.precision.autocast(autocast_handler)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divide gradients by the fp16 loss scale (before clipping); a no-op otherwise."""
        if self.scaler is None:
            return
        targets = optimizer if isinstance(optimizer, list | tuple) else [optimizer]
        for opt in self._optimizers if optimizer is None else targets:
            if isinstance(opt, AcceleratedOptimizer):
                opt.unscale_()
            else:
                self.scaler.unscale_(opt)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2):
        """``torch.nn.utils.clip_grad_norm_`` on unscaled gradients; returns the total norm."""
        self.unscale_gradients()
        return self.strategy.clip_grad_norm_(list(parameters), max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """``torch.nn.utils.clip_grad_value_`` on unscaled gradients."""
        self.unscale_gradients()
        self.strategy.clip_grad_value_(list(parameters), clip_value)


def _has_device_map(model: torch.nn.Module) -> bool:
    device_map = getattr(model, "hf_device_map", None)
    return isinstance(device_map, dict) and len(set(device_map.values())) > 1


def _refuse_offloaded_quantized(model: torch.nn.Module) -> None:
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


def _dynamo_options(plugin: Any) -> dict[str, Any]:
    if plugin is None:
        return {}
    if isinstance(plugin, dict):
        return {k: v for k, v in plugin.items() if k != "backend"}
    return {k: getattr(plugin, k) for k in ("mode", "fullgraph", "dynamic") if hasattr(plugin, k)}
