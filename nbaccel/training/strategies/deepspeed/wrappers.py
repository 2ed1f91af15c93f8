"""What ``prepare`` hands back under DeepSpeed, and the placeholders a config's optimizer needs.

The engine does the work: ``accelerator.backward(loss)`` runs the engine's backward and, at the
end of an accumulation cycle, its step (optimizer, scheduler, zeroing). The optimizer and scheduler
wrappers keep the user's ``optimizer.step(); scheduler.step(); optimizer.zero_grad()`` loop
valid by making those calls no-ops. ``DummyOptim`` / ``DummyScheduler`` stand for an optimizer /
scheduler the DeepSpeed config defines. ``GatheredParameters`` is DeepSpeed's, imported on use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nbaccel.training.step.optimizer import AcceleratedOptimizer
from nbaccel.training.step.scheduler import AcceleratedScheduler

__all__ = [
    "DeepSpeedEngineWrapper",
    "DeepSpeedOptimizerWrapper",
    "DeepSpeedSchedulerWrapper",
    "DummyOptim",
    "DummyScheduler",
    "GatheredParameters",
    "map_pytorch_optim_to_deepspeed",
]


class DeepSpeedEngineWrapper:
    """Drives one ``DeepSpeedEngine`` through the Accelerator's training-loop calls."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def backward(self, loss: torch.Tensor, sync_gradients: bool = True, **kwargs: Any) -> None:
        """The engine's backward (it scales for accumulation); at a boundary, its step."""
        self.engine.set_gradient_accumulation_boundary(is_boundary=sync_gradients)
        self.engine.backward(loss, **kwargs)
        if sync_gradients:
            self.engine.step()

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm the engine computed at its last step."""
        norm = self.engine.get_global_grad_norm()
        return norm.item() if hasattr(norm, "item") else norm


class DeepSpeedOptimizerWrapper(AcceleratedOptimizer):
    """The engine's optimizer: ``step`` and ``zero_grad`` are done by ``accelerator.backward``."""

    def __init__(self, optimizer: Any) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)
        self.__has_overflow__ = hasattr(self.optimizer, "overflow")

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Nothing: the engine zeroes gradients after its step."""

    def step(self, closure: Any = None) -> None:
        """Nothing: the engine stepped in ``accelerator.backward``."""

    @property
    def step_was_skipped(self) -> bool:
        """Whether the engine skipped its last step (fp16 overflow)."""
        return bool(getattr(self.optimizer, "overflow", False)) if self.__has_overflow__ else False

    def __repr__(self) -> str:
        return f"DeepSpeedOptimizerWrapper({type(self.optimizer).__name__})"


class DeepSpeedSchedulerWrapper(AcceleratedScheduler):
    """A scheduler the engine steps: ``step`` here does nothing."""

    def __init__(self, scheduler: Any, optimizers: Any) -> None:
        super().__init__(scheduler, optimizers if isinstance(optimizers, list) else [optimizers])

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: the engine steps its scheduler with its optimizer."""


class DummyOptim:
    """Stands for the optimizer the DeepSpeed config's ``optimizer`` section defines.

    Args:
        params: the parameters (or parameter groups) to optimise.
        lr: fills ``optimizer.params.lr`` when it is "auto".
        weight_decay: fills ``optimizer.params.weight_decay`` when it is "auto".
    """

    def __init__(self, params: Any, lr: float = 0.001, weight_decay: float = 0, **kwargs: Any):
        self.params = list(params) if not isinstance(params, list) else params
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs


class DummyScheduler:
    """Stands for the scheduler the DeepSpeed config's ``scheduler`` section defines (or one
    ``lr_scheduler_callable(optimizer)`` builds).

    Args:
        optimizer: the (Dummy) optimizer it schedules.
        total_num_steps: fills ``scheduler.params.total_num_steps`` when "auto".
        warmup_num_steps: fills ``scheduler.params.warmup_num_steps`` when "auto".
        lr_scheduler_callable: builds the scheduler from the engine's optimizer.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int | None = None,
        warmup_num_steps: int = 0,
        lr_scheduler_callable: Callable[[Any], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs


def GatheredParameters(
    params: Any, modifier_rank: int | None = None, fwd_module: Any = None, enabled: bool = True
) -> Any:
    """DeepSpeed's ``zero.GatheredParameters``: inside, ZeRO-3-partitioned ``params`` are whole
    on every rank (changes made on ``modifier_rank`` are kept). A no-op for other parameters."""
    from nbaccel.training.strategies.deepspeed.plugin import _run_device
    from nbaccel.training.strategies.deepspeed.runtime import import_deepspeed

    deepspeed = import_deepspeed(_run_device())
    return deepspeed.zero.GatheredParameters(
        params, modifier_rank=modifier_rank, fwd_module=fwd_module, enabled=enabled
    )


def map_pytorch_optim_to_deepspeed(optimizer: torch.optim.Optimizer) -> Any:
    """The DeepSpeed optimizer for a torch one whose state is offloaded to the CPU: Adam/AdamW ->
    ``DeepSpeedCPUAdam``, Adagrad -> ``DeepSpeedCPUAdagrad``, Lion -> ``DeepSpeedCPULion``
    (other optimizers are returned as they are)."""
    from nbaccel.training.strategies.deepspeed.plugin import _run_device
    from nbaccel.training.strategies.deepspeed.runtime import import_deepspeed

    import_deepspeed(_run_device())
    defaults = {k: v for k, v in optimizer.defaults.items() if k in ("lr", "weight_decay")}
    name = type(optimizer).__name__
    if name in ("Adam", "AdamW"):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        extra = {"betas": optimizer.defaults.get("betas", (0.9, 0.999)),
                 "eps": optimizer.defaults.get("eps", 1e-8)}  # fmt: skip
        return DeepSpeedCPUAdam(
            optimizer.param_groups, adamw_mode=name == "AdamW", **defaults, **extra
        )
    if name == "Adagrad":
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

        return DeepSpeedCPUAdagrad(optimizer.param_groups, **defaults)
    if name == "Lion":
        from deepspeed.ops.lion import DeepSpeedCPULion

        return DeepSpeedCPULion(optimizer.param_groups, **defaults)
    return optimizer
