"""The strategy interface: everything in training that depends on the kind of parallelism.

A :class:`Strategy` is chosen once per ``Accelerator`` (:func:`~nbaccel.training.strategies.
registry.select_strategy`, keyed by ``DistributedType``); the Accelerator, the checkpoint module
and the optimizer wrapper call its methods instead of asking which kind of run this is, or what
type a model has: ``no_sync``, ``trigger_sync``, ``unwrap_model`` and ``mixed_precision_policy``
are answered by the strategy that added the wrappers.

This base class is a single process on one device: the model is placed and left unwrapped,
gradients are clipped and stepped by torch, state dicts are the module's own. Subclasses:
``DDPStrategy`` (``strategies.ddp``), ``FSDPStrategy`` (``strategies.fsdp``), ``XLAStrategy``
(``strategies.xla``). Collectives differ per backend too, but they live one layer down, in
:mod:`nbaccel.distributed.comm` (``PartialState().communicator``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from nbaccel.distributed.state import AcceleratorState
from nbaccel.storage.weights import load_into_model
from nbaccel.training.config.kwargs_handlers import DistributedDataParallelKwargs
from nbaccel.training.precision.policy import PrecisionPolicy
from nbaccel.training.strategies.repoint import remember_moves, repoint_optimizer
from nbaccel.training.strategies.wrappers import unwrap_with

__all__ = ["Strategy"]


class Strategy:
    """How one kind of run prepares, steps and saves a model (base: one process, one device).

    Args:
        state: the process's ``AcceleratorState``.
        precision: the accelerator's mixed-precision policy (forward wrapping, loss scaling).
        ddp_kwargs: the user's ``DistributedDataParallelKwargs``, for strategies that use DDP.
    """

    #: ``prepare_model`` gives the model new Parameter objects (optimizers must follow them).
    replaces_parameters = False
    #: ``prepare`` hands every object to :meth:`prepare_together` (an engine built from the
    #: model, optimizer and scheduler at once: DeepSpeed)
    prepares_together = False
    #: the engine divides the loss for gradient accumulation (the Accelerator does not)
    engine_scales_accumulation = False
    #: the engine does mixed precision itself (no GradScaler from the Accelerator)
    owns_precision = False
    #: prepared models hold only this rank's shard of the weights (``save_pretrained`` gathers)
    shards_weights = False

    def __init__(
        self,
        state: AcceleratorState,
        precision: PrecisionPolicy,
        ddp_kwargs: DistributedDataParallelKwargs | None = None,
    ) -> None:
        self.state = state
        self.precision = precision
        self.ddp_kwargs = ddp_kwargs

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def joins_uneven_inputs(self) -> bool:
        """Whether ``join_uneven_inputs`` runs torch's ``Join`` (DDP across processes)."""
        return False

    @property
    def mixed_precision_policy(self) -> Any:
        """The sharding engine's own mixed-precision policy (FSDP2's ``MixedPrecisionPolicy``);
        None where mixed precision is autocast only."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.state.distributed_type.value}, {self.device})"

    # -- model, optimizer, data ---------------------------------------------------------------
    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        """Place ``model``, add the mixed-precision forward, wrap it (not for evaluation)."""
        before = dict(model.named_parameters()) if self.replaces_parameters else None
        if device_placement:
            model = model.to(self.device)
        self.precision.wrap_forward(model)
        if before is not None:  # an XLA move: optimizers built earlier must follow
            remember_moves(model, before, dict(model.named_parameters()))
        return model if evaluation_mode else self.wrap_model(model)

    def prepare_together(
        self, args: list[Any], run: Any, prepare_loader: Any, register: Any
    ) -> list[Any]:
        """Prepare all of ``args`` at once (strategies with ``prepares_together``)."""
        raise NotImplementedError(f"{type(self).__name__} prepares objects one by one.")

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The parallel wrapper around a placed model (none here)."""
        return model

    def prepare_optimizer(self, optimizer: Any, models: Iterable[torch.nn.Module]) -> None:
        """Make ``optimizer`` update the parameters of the prepared ``models`` (re-point it where
        preparing them replaced their parameters)."""
        repoint_optimizer(optimizer, models)

    #: ranks that read different batches and this rank's index among them (None: every rank of
    #: the run, as plain data parallelism); mesh strategies shard data over their dp axes only
    data_parallel_size: int | None = None
    data_parallel_rank: int | None = None

    def context_parallel(self, buffers: Any, buffer_seq_dims: Any, no_restore_buffers: Any) -> Any:
        """The context in which ``buffers`` are split along their sequence dims (none here)."""
        return contextlib.nullcontext()

    def prepare_dataloader(self, dataloader: Any) -> Any:
        """The last step of preparing a (sharded) dataloader (nothing here)."""
        return dataloader

    def plan_batches(self, loaders: list[Any]) -> None:
        """See the dataloaders one ``prepare`` call gets, before any is prepared (nothing here)."""

    def rebatch(self, loader: Any) -> Any:
        """The first step of preparing a dataloader: its batches as this strategy runs them."""
        return loader

    def scheduler_for(self, scheduler: Any) -> tuple[Any, int | None]:
        """The scheduler to wrap and how many steps it takes per optimizer step (None: one per
        process, or one with split batches); a stand-in (``MegatronLMDummyScheduler``) becomes
        the scheduler it stands for."""
        if getattr(scheduler, "stands_for_a_scheduler", False):
            return self.make_scheduler(scheduler), 1
        return scheduler, None

    def make_scheduler(self, stand_in: Any) -> Any:
        """The scheduler a stand-in (``MegatronLMDummyScheduler``) stands for."""
        raise ValueError(
            f"{type(stand_in).__name__} stands for Megatron-LM's scheduler, which runs with "
            "Accelerator(megatron_lm_plugin=MegatronLMPlugin(...)) (or nbaccel launch "
            "--use_megatron_lm); here pass a torch scheduler (get_scheduler(...))."
        )

    def unwrap_model(
        self,
        model: torch.nn.Module,
        keep_fp32_wrapper: bool = True,
        keep_torch_compile: bool = True,
    ) -> torch.nn.Module:
        """The user's module inside the wrappers ``prepare`` added: ``torch.compile``'s (kept
        unless ``keep_torch_compile=False``), the strategy's own (:meth:`unwrap_parallel`) and
        the mixed-precision forward (removed with ``keep_fp32_wrapper=False``)."""
        return unwrap_with(model, self.unwrap_parallel, keep_fp32_wrapper, keep_torch_compile)

    def unwrap_parallel(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` without torch's data-parallel wrappers (``DataParallel``, DDP): this
        strategy adds none, but a model the user wrapped is unwrapped too, as Accelerate's
        ``unwrap_model`` does."""
        while isinstance(model, torch.nn.DataParallel | DistributedDataParallel):
            model = model.module
        return model

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """A context in which backward passes of ``model`` do not synchronise gradients
        (nothing to synchronise here)."""
        return contextlib.nullcontext()

    def trigger_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Make the next backward synchronise although its forward ran under :meth:`no_sync`."""
        return contextlib.nullcontext()

    # -- the training step --------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, scaled under fp16."""
        self.precision.scale_and_backward(loss, **kwargs)

    def clip_grad_norm_(
        self, parameters: list[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        """Clip the (unscaled) gradients of ``parameters`` by their total norm; return it."""
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: list[torch.Tensor], clip_value: float) -> None:
        """Clip the (unscaled) gradients of ``parameters`` elementwise."""
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
        """One step of the (unwrapped) ``optimizer`` on this process's gradients."""
        return optimizer.step(closure) if closure is not None else optimizer.step()

    # -- state dicts --------------------------------------------------------------------------
    def model_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The full state dict of a prepared model (collective for sharded strategies)."""
        return (self.unwrap_model(model) if unwrap else model).state_dict()

    def load_model_state_dict(
        self,
        model: torch.nn.Module,
        tensors: Mapping[str, torch.Tensor],
        aliases: Mapping[str, str] | None = None,
        strict: bool = True,
    ) -> None:
        """Load a full state dict (``aliases``: the file's tied-name record) into ``model``."""
        load_into_model(self.unwrap_model(model), tensors, aliases, strict=strict)

    def optimizer_state_dict(self, optimizer: Any, model: torch.nn.Module | None) -> dict:
        """The full state dict of ``optimizer`` (``model``: the prepared model it updates)."""
        return getattr(optimizer, "optimizer", optimizer).state_dict()

    def load_optimizer_state_dict(
        self, optimizer: Any, state_dict: dict, model: torch.nn.Module | None
    ) -> None:
        """Load a full optimizer state dict."""
        getattr(optimizer, "optimizer", optimizer).load_state_dict(state_dict)

    # -- checkpoints in the strategy's own format ---------------------------------------------
    #: Models and optimizers are checkpointed by the strategy (``save_sharded_checkpoint``)
    #: instead of as full state dicts written by the checkpoint module.
    sharded_checkpoints = False

    def save_sharded_checkpoint(self, objects: Any, directory: Any) -> list[str]:
        """Write the models and optimizers of ``objects`` (``.models``, ``.optimizers``) into
        ``directory`` in the strategy's own format (every rank calls it); return the names."""
        raise NotImplementedError(f"{type(self).__name__} has no sharded checkpoint format.")

    def load_sharded_checkpoint(self, objects: Any, directory: Any) -> None:
        """Restore what :meth:`save_sharded_checkpoint` wrote into ``objects``."""
        raise NotImplementedError(f"{type(self).__name__} has no sharded checkpoint format.")
