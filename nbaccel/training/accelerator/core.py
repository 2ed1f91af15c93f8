"""``Accelerator``: the training API users call, as a thin orchestrator over nbaccel's modules.

Who runs where: :mod:`nbaccel.distributed.state`. Mixed precision:
:mod:`nbaccel.training.precision.policy`. Everything that depends on the kind of parallelism (model
wrapping, clipping, optimizer step, state dicts, sharded checkpoints): the ``Strategy`` chosen
once in ``__init__`` (:mod:`nbaccel.training.strategies`).
Optimizer / scheduler wrappers: :mod:`nbaccel.training.step.optimizer`,
:mod:`nbaccel.training.step.scheduler`. Data sharding: :mod:`nbaccel.data`. Checkpoints:
:mod:`nbaccel.training.checkpointing.state`, :mod:`nbaccel.storage.weights`. Trackers:
:mod:`nbaccel.training.tracking.trackers`.
This class keeps the prepared objects and the accumulation step counter, and routes calls.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from nbaccel.data import DataLoaderDispatcher, DataLoaderShard, prepare_data_loader
from nbaccel.distributed.state import AcceleratorState, GradientState, PartialState
from nbaccel.training.accelerator.attributes import AcceleratorAttributes
from nbaccel.training.accelerator.delegate import Delegate, DelegatedAttribute
from nbaccel.training.accelerator.preparation import (
    check_parallelism,
    choose_precision,
    finish_model,
    has_device_map,
    mark_prepared,
    refuse_offloaded_quantized,
)
from nbaccel.training.accelerator.process_control import ProcessControl
from nbaccel.training.checkpointing.model_files import save_model_files, save_object
from nbaccel.training.checkpointing.registered import Checkpointing
from nbaccel.training.checkpointing.state import Checkpointables
from nbaccel.training.config.configuration import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    accumulation_plugin,
)
from nbaccel.training.config.kwargs_handlers import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
    sort_handlers,
)
from nbaccel.training.precision.fp8.recipes import AORecipeKwargs, TERecipeKwargs
from nbaccel.training.step.batch_size import release_memory
from nbaccel.training.step.compilation import Compilation
from nbaccel.training.step.optimizer import AcceleratedOptimizer
from nbaccel.training.step.scheduler import AcceleratedScheduler
from nbaccel.training.strategies.deepspeed.launch import requested_plugins
from nbaccel.training.strategies.fsdp.plugin import FullyShardedDataParallelPlugin
from nbaccel.training.strategies.megatron import launch as megatron_launch
from nbaccel.training.strategies.megatron import scheduler as megatron_scheduler
from nbaccel.training.strategies.registry import select_strategy
from nbaccel.training.tracking.tracker_set import TrackerSet

__all__ = ["Accelerator"]


class Accelerator(AcceleratorAttributes):
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
        self.handlers = sort_handlers(kwargs_handlers or [], (AORecipeKwargs, TERecipeKwargs))
        group = self.handlers.get(InitProcessGroupKwargs)
        group_options = {} if group is None else group.to_kwargs()
        group_options.pop("init_method", None)
        if fsdp_plugin is None and deepspeed_plugin is None:
            fsdp_plugin = FullyShardedDataParallelPlugin.from_environment()  # launch --use_fsdp
        megatron_lm_plugin = megatron_launch.requested(  # or launch --use_megatron_lm's
            megatron_lm_plugin, deepspeed_plugin or fsdp_plugin, PartialState(cpu, **group_options)
        )
        self.state = AcceleratorState(
            mixed_precision=mixed_precision,
            cpu=cpu,
            dynamo_plugin=dynamo_plugin,
            fsdp_plugin=fsdp_plugin,
            deepspeed_plugin=deepspeed_plugin,
            _from_accelerator=True,
            **group_options,
        )
        megatron_launch.attach(self.state, megatron_lm_plugin)
        self.parallelism_config = check_parallelism(parallelism_config, self, torch_tp_plugin)
        self.project_configuration = project_config or ProjectConfiguration()
        if project_dir is not None:
            self.project_configuration.set_directories(project_dir)
        plugin = accumulation_plugin(gradient_accumulation_plugin, gradient_accumulation_steps)
        self.gradient_state = GradientState(plugin)
        self.dataloader_config = dataloader_config or DataLoaderConfiguration()
        if split_batches:
            self.dataloader_config.split_batches = True
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.rng_types = list(rng_types) if rng_types is not None else ["generator"]
        self.dynamo_plugin = dynamo_plugin
        self.precision = choose_precision(self.state, self.handlers)
        self.compilation = Compilation(dynamo_backend, dynamo_plugin)
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
        self._trackers = TrackerSet(log_with, self.logging_dir, self.is_main_process)
        # the parts that do the work of the methods delegated to them below
        self._control = ProcessControl(
            self.state, self.gradient_state, self._trackers, self.profile_handler
        )
        self._checkpoints = Checkpointing(self.project_configuration, self.state)

    # -- served by the parts an Accelerator holds ----------------------------------------------
    gather = Delegate("_control", ProcessControl.gather)
    gather_for_metrics = Delegate("_control", ProcessControl.gather_for_metrics)
    reduce = Delegate("_control", ProcessControl.reduce)
    pad_across_processes = Delegate("_control", ProcessControl.pad_across_processes)
    print = Delegate("_control", ProcessControl.print)
    wait_for_everyone = Delegate("_control", ProcessControl.wait_for_everyone)
    main_process_first = Delegate("_control", ProcessControl.main_process_first)
    local_main_process_first = Delegate("_control", ProcessControl.local_main_process_first)
    split_between_processes = Delegate("_control", ProcessControl.split_between_processes)
    on_main_process = Delegate("_control", ProcessControl.on_main_process)
    on_local_main_process = Delegate("_control", ProcessControl.on_local_main_process)
    on_last_process = Delegate("_control", ProcessControl.on_last_process)
    on_process = Delegate("_control", ProcessControl.on_process)
    on_local_process = Delegate("_control", ProcessControl.on_local_process)
    set_trigger = Delegate("_control", ProcessControl.set_trigger)
    check_trigger = Delegate("_control", ProcessControl.check_trigger)
    skip_first_batches = Delegate("_control", ProcessControl.skip_first_batches)
    init_trackers = Delegate("_control", ProcessControl.init_trackers)
    log = Delegate("_control", ProcessControl.log)
    get_tracker = Delegate("_control", ProcessControl.get_tracker)
    end_training = Delegate("_control", ProcessControl.end_training)
    profile = Delegate("_control", ProcessControl.profile)
    flag_tensor = DelegatedAttribute("_control", "flag_tensor")
    log_with = property(lambda self: list(self._trackers.wanted), doc="The trackers asked for.")
    register_for_checkpointing = Delegate("_checkpoints", Checkpointing.register_for_checkpointing)
    register_save_state_pre_hook = Delegate("_checkpoints", Checkpointing.register_save_hook)
    register_load_state_pre_hook = Delegate("_checkpoints", Checkpointing.register_load_hook)

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
        self.strategy.plan_batches([a for a in args if isinstance(a, DataLoader)])
        kinds = (
            (torch.nn.Module, self.prepare_model),
            (torch.optim.Optimizer, self.prepare_optimizer),
            (DataLoader, self.prepare_data_loader),
            (torch.optim.lr_scheduler.LRScheduler, lambda s, p: self.prepare_scheduler(s)),
            (megatron_scheduler.MegatronLMDummyScheduler, lambda s, p: self.prepare_scheduler(s)),
        )
        for kind, prepare_one in kinds:  # models first: FSDP may replace their parameters
            for i, obj in enumerate(args):
                if isinstance(obj, kind) and not isinstance(obj, AcceleratedScheduler):
                    result[i] = mark_prepared(prepare_one(obj, placement[i]))
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
        refuse_offloaded_quantized(model)
        if device_placement is None:
            device_placement = self.device_placement
        place = device_placement and not has_device_map(model)
        before = dict(model.named_parameters(remove_duplicate=False))
        model = finish_model(
            self, self.strategy.prepare_model(model, place, evaluation_mode), before
        )
        self._models.append(mark_prepared(model))
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
        self._optimizers.append(mark_prepared(wrapped))
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
        data_loader = self.strategy.rebatch(data_loader)
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
        prepared = mark_prepared(self.strategy.prepare_dataloader(prepared))
        self._dataloaders.append(prepared)
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Wrap ``scheduler`` to step with its prepared optimizer(s) (a stand-in: Megatron's)."""
        scheduler, steps = self.strategy.scheduler_for(scheduler)
        target = getattr(scheduler, "optimizer", None)
        followed = [o for o in self._optimizers if o is target or o.optimizer is target]
        wrapped = AcceleratedScheduler(
            scheduler,
            followed or [target],
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.split_batches or steps == 1,
        )
        wrapped.num_processes = steps or wrapped.num_processes
        self._schedulers.append(mark_prepared(wrapped))
        return wrapped

    def _register_prepared(self, kind: str, obj: Any) -> None:
        """Record an object a strategy prepared itself (``prepares_together``)."""
        {"model": self._models, "optimizer": self._optimizers, "scheduler": self._schedulers}[
            kind
        ].append(mark_prepared(obj))

    def verify_device_map(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` was dispatched over several devices (big-model inference)."""
        return has_device_map(model)

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

    # -- persistence ------------------------------------------------------------------------------
    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile=True
    ) -> torch.nn.Module:
        """The user's module inside the wrappers ``prepare`` added."""
        return self.strategy.unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The full state dict of a prepared model (gathered when sharded: call on every rank)."""
        return self.strategy.model_state_dict(model, unwrap)

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Save weights as safetensors shards + index (written by the main process, atomically)."""
        writer = self.is_main_process
        args = (max_shard_size, safe_serialization)
        save_model_files(model, self.get_state_dict, save_directory, writer, *args)

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """``torch.save`` once per machine (or per node), atomically."""
        on_each_node = self.project_configuration.save_on_each_node
        if self.is_local_main_process if on_each_node else self.is_main_process:
            save_object(obj, f, safe_serialization)

    def _checkpointables(self) -> Checkpointables:
        models, optimizers = list(self._models), list(self._optimizers)
        schedulers, loaders = list(self._schedulers), list(self._dataloaders)
        return Checkpointables(models, optimizers, schedulers, loaders, scaler=self.scaler)

    def save_state(
        self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True, **_
    ) -> str:
        """Save models, optimizers, schedulers, scaler, RNG states, dataloader positions and
        registered objects (every process calls it). Returns the checkpoint directory."""
        objects, strategy = self._checkpointables(), self.strategy
        return self._checkpoints.save(output_dir, objects, strategy, self.step, safe_serialization)

    def load_state(
        self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None, **kw
    ) -> None:
        """Restore what ``save_state`` wrote (every process calls it)."""
        objects, strict = self._checkpointables(), kw.get("strict", True)
        self.step = self._checkpoints.load(input_dir, objects, self.strategy, strict)

    def free_memory(self, *objects: Any) -> list[None]:
        """Forget every prepared object, reset ``step`` and empty device caches."""
        self._models, self._optimizers, self._schedulers, self._dataloaders = [], [], [], []
        self._checkpoints.custom_objects.clear()
        self.step = 0
        return release_memory(*objects)

    clear = free_memory
