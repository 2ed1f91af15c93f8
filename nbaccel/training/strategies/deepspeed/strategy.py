"""DeepSpeed ZeRO behind the Accelerator's strategy interface: ``DeepSpeedStrategy``.

``prepare`` hands the model, optimizer and scheduler to ``deepspeed.initialize`` together (the
config filled and checked by :mod:`.deepspeed_prepare`) and returns the engine (an
``nn.Module``) with optimizer / scheduler wrappers whose ``step`` the engine does
(:mod:`.deepspeed_wrappers`). ``backward`` is the engine's (it scales for accumulation and steps at
the boundary), state dicts gather ZeRO-3 partitions, checkpoints are DeepSpeed's own layout
(``<dir>/pytorch_model/`` with one optimizer shard per rank), written into the checkpoint
module's staging directory so a save stays atomic. Precision is the engine's (fp16/bf16 from the
config, filled from ``mixed_precision``): no autocast wrapper and no GradScaler here.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from nbaccel.distributed.state import AcceleratorState, GradientState
from nbaccel.training.config.kwargs_handlers import DistributedDataParallelKwargs
from nbaccel.training.precision.policy import PrecisionPolicy
from nbaccel.training.strategies.base import Strategy
from nbaccel.training.strategies.deepspeed.prepare import engine_request, split_prepare_args
from nbaccel.training.strategies.deepspeed.runtime import import_deepspeed
from nbaccel.training.strategies.deepspeed.wrappers import (
    DeepSpeedEngineWrapper,
    DeepSpeedOptimizerWrapper,
    DeepSpeedSchedulerWrapper,
)

__all__ = ["DeepSpeedStrategy", "engine_of"]

_TAG = "pytorch_model"


def engine_of(model: Any) -> Any:
    """The ``DeepSpeedEngine`` ``model`` is (or sits under ``torch.compile``), else None."""
    inner = getattr(model, "_orig_mod", model)
    return inner if type(inner).__name__ == "DeepSpeedEngine" else None


def _partitioned(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")


class DeepSpeedStrategy(Strategy):
    """One DeepSpeed engine per prepared model, on the process group the state started."""

    #: ``prepare`` gives the model, optimizer and scheduler to the strategy together
    prepares_together = True
    #: the engine divides the loss for gradient accumulation itself
    engine_scales_accumulation = True
    #: the engine does mixed precision: no autocast wrapper, no GradScaler
    owns_precision = True
    sharded_checkpoints = True

    def __init__(
        self,
        state: AcceleratorState,
        precision: PrecisionPolicy,
        ddp_kwargs: DistributedDataParallelKwargs | None = None,
    ) -> None:
        super().__init__(state, precision, ddp_kwargs)
        asked = state.mixed_precision
        for plugin in state.deepspeed_plugins.values():  # contradictions raise, naming the keys
            chosen = plugin.set_mixed_precision(asked)
            if plugin.selected and asked == "no" and chosen != "no":
                state.mixed_precision = chosen  # the config turned it on
        self.engines: list[Any] = []
        self.wrapped: DeepSpeedEngineWrapper | None = None
        self._clip_warned = False

    @property
    def plugin(self) -> Any:
        return self.state.deepspeed_plugin

    # -- prepare ------------------------------------------------------------------------------
    def prepare_together(
        self,
        args: list[Any],
        run: Any,
        prepare_loader: Callable[[DataLoader], DataLoader],
        register: Callable[[str, Any], None],
    ) -> list[Any]:
        """Prepare ``args`` (any order): loaders sharded, model + optimizer + scheduler made one
        engine. ``run`` is the Accelerator (batch options, accumulation steps); ``register(kind,
        obj)`` records a prepared model / optimizer / scheduler on it."""
        deepspeed = import_deepspeed(self.device)
        models, optimizers, schedulers = split_prepare_args(args, deepspeed)
        result = [prepare_loader(a) if isinstance(a, DataLoader) else a for a in args]
        if not models:
            return result
        plugin = self.plugin
        request = engine_request(plugin, run, args, models, optimizers, schedulers, deepspeed)
        engine, optimizer, _, scheduler = deepspeed.initialize(**request.kwargs)
        self.engines.append(engine)
        result[request.model_index] = engine
        register("model", engine)
        if optimizer is not None and request.optimizer_index is not None:
            wrapped = DeepSpeedOptimizerWrapper(optimizer)
            result[request.optimizer_index] = wrapped
            register("optimizer", wrapped)
            if self.wrapped is None:
                self.wrapped = DeepSpeedEngineWrapper(engine)
            else:
                warnings.warn(
                    "This Accelerator already drives a DeepSpeed engine with an optimizer; "
                    "accelerator.backward keeps stepping the first one. Train a second model "
                    "with a second Accelerator (see the multiple-models guide).",
                    stacklevel=3,
                )
        if request.scheduler_index is not None:
            if scheduler is not None:  # the engine steps it
                sched = DeepSpeedSchedulerWrapper(scheduler, result[request.optimizer_index])
            else:
                from nbaccel.training.step.scheduler import AcceleratedScheduler

                sched = AcceleratedScheduler(
                    args[request.scheduler_index],
                    [result[request.optimizer_index]],
                    step_with_optimizer=run.step_scheduler_with_optimizer,
                    split_batches=run.split_batches,
                )
            result[request.scheduler_index] = sched
            register("scheduler", sched)
        return result

    def prepare_model(
        self, model: nn.Module, device_placement: bool, evaluation_mode: bool = False
    ) -> nn.Module:
        raise RuntimeError("Under DeepSpeed, models are prepared by accelerator.prepare(...).")

    def unwrap_parallel(self, model: nn.Module) -> nn.Module:
        while True:
            engine = engine_of(model)
            if engine is not None:
                model = engine.module
            elif isinstance(model, nn.parallel.DistributedDataParallel):
                model = model.module
            else:
                return model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Nothing: the engine reduces gradients only at the accumulation boundary."""
        return contextlib.nullcontext()

    # -- the training step --------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.wrapped is None:
            raise RuntimeError(
                "accelerator.backward under DeepSpeed needs a model prepared together with its "
                "optimizer: accelerator.prepare(model, optimizer, ...)."
            )
        self.wrapped.backward(loss, sync_gradients=GradientState().sync_gradients, **kwargs)

    def clip_grad_norm_(
        self, parameters: list[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor | None:
        """The engine clips by the config's ``gradient_clipping`` inside its step; this returns
        the norm it found (and warns once when ``max_norm`` differs from the config's)."""
        configured = self.plugin.get_value("gradient_clipping")
        if not self._clip_warned and configured is not None and float(configured) != max_norm:
            warnings.warn(
                f"clip_grad_norm_(max_norm={max_norm}) under DeepSpeed: the engine clips by the "
                f"config's gradient_clipping={configured} inside its step. Set gradient_clipping "
                "(DeepSpeedPlugin(gradient_clipping=...) or the config) to change it.",
                stacklevel=3,
            )
            self._clip_warned = True
        if self.wrapped is None:
            return None
        norm = self.wrapped.get_global_grad_norm()
        return None if norm is None else torch.tensor(float(norm))

    def clip_grad_value_(self, parameters: list[torch.Tensor], clip_value: float) -> None:
        raise ValueError(
            "clip_grad_value_ is not available under DeepSpeed: the engine clips by norm "
            "(gradient_clipping in the DeepSpeed config)."
        )

    # -- state dicts --------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The full state dict; under ZeRO-3 gathered (collective: every rank calls it) and
        returned on rank 0 only (16-bit when ``stage3_gather_16bit_weights_on_model_save``)."""
        engine = engine_of(model)
        module = self.unwrap_model(model)
        params = list(module.parameters())
        if not any(_partitioned(p) for p in params):
            return module.state_dict()
        if engine is not None and self.plugin.get_value(
            "zero_optimization.stage3_gather_16bit_weights_on_model_save", False
        ):
            return dict(engine._zero3_consolidated_16bit_state_dict())
        return self._gathered_state_dict(module)

    def _gathered_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        deepspeed = import_deepspeed(self.device)
        main = self.state.is_main_process
        tensors = module.state_dict(keep_vars=True)
        out: dict[str, torch.Tensor] = {}
        # every rank records each tensor it gathered (tied weights appear under several names),
        # so every rank walks the same sequence of gathers; only rank 0 keeps the values
        done: dict[int, torch.Tensor | None] = {}
        for name, tensor in tensors.items():
            if id(tensor) in done:
                if main:
                    out[name] = done[id(tensor)]
                continue
            if _partitioned(tensor):
                with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
                    value = tensor.data.detach().clone().cpu() if main else None
            else:
                value = tensor.detach().clone().cpu() if main else None
            done[id(tensor)] = value
            if main:
                out[name] = value
        return out

    def load_model_state_dict(
        self,
        model: nn.Module,
        tensors: Mapping[str, torch.Tensor],
        aliases: Mapping[str, str] | None = None,
        strict: bool = True,
    ) -> None:
        """Load a full state dict (every rank passes the same one); ZeRO-3 partitions are
        gathered, written and re-partitioned."""
        module = self.unwrap_model(model)
        params = dict(module.named_parameters())
        if not any(_partitioned(p) for p in params.values()):
            super().load_model_state_dict(model, tensors, aliases, strict)
            return
        deepspeed = import_deepspeed(self.device)
        names = set(module.state_dict().keys())
        missing = sorted(names - set(tensors) - set(aliases or {}))
        if strict and missing:
            raise KeyError(f"Missing keys in the state dict: {missing}")
        for name, param in params.items():
            source = tensors.get(name, tensors.get((aliases or {}).get(name, ""), None))
            if source is None:
                continue
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if self.state.is_main_process:
                    param.data.copy_(source.to(param.dtype))

    def optimizer_state_dict(self, optimizer: Any, model: nn.Module | None) -> dict:
        return getattr(optimizer, "optimizer", optimizer).state_dict()

    # -- checkpoints: DeepSpeed's own layout --------------------------------------------------
    def _engines(self, models: Iterable[Any]) -> list[Any]:
        engines = [engine_of(m) for m in models]
        if any(e is None for e in engines):
            raise ValueError("A model in this checkpoint was not prepared by DeepSpeed.")
        return engines

    def save_sharded_checkpoint(self, objects: Any, directory: Any) -> list[str]:
        tags = []
        for i, engine in enumerate(self._engines(objects.models)):
            tag = _TAG if i == 0 else f"{_TAG}_{i}"
            engine.save_checkpoint(str(directory), tag=tag, save_latest=i == 0)
            tags.append(tag)
        return tags

    def load_sharded_checkpoint(self, objects: Any, directory: Any) -> None:
        for i, engine in enumerate(self._engines(objects.models)):
            tag = _TAG if i == 0 else f"{_TAG}_{i}"
            path, _ = engine.load_checkpoint(str(directory), tag=tag)
            if path is None:
                raise FileNotFoundError(
                    f"No DeepSpeed checkpoint {tag!r} in {directory}: was it saved by "
                    "save_state with the same models prepared in the same order?"
                )
