"""``AcceleratedOptimizer``: an optimizer that knows about gradient accumulation and loss scaling.

It behaves like the optimizer it wraps (``param_groups``, ``state_dict``, ...), but

- ``step()`` and ``zero_grad()`` do nothing on accumulation steps (``GradientState.sync_gradients``
  is False), so the plain ``step(); zero_grad()`` loop body accumulates correctly;
- under fp16 the step goes through the ``GradScaler``; when the scaled gradients overflowed the
  step is skipped and ``step_was_skipped`` says so (schedulers then hold the learning rate);
- otherwise the step goes through ``step_fn`` when given: the strategy's optimizer step (on XLA,
  torch-xla's, which also all-reduces the gradients).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nbaccel.distributed.state import GradientState

__all__ = ["AcceleratedOptimizer"]


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` for accumulation-aware, scaler-aware stepping.

    Args:
        optimizer: the torch optimizer.
        device_placement: move a loaded optimizer state to the parameters' device.
        scaler: the fp16 ``torch.amp.GradScaler``, or None.
        step_fn: ``step_fn(optimizer, closure)`` steps the wrapped optimizer (default: its own
            ``step``); the Accelerator passes its strategy's ``optimizer_step``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        device_placement: bool = True,
        scaler: torch.amp.GradScaler | None = None,
        step_fn: Callable[[torch.optim.Optimizer, Any], Any] | None = None,
    ) -> None:
        # Deliberately no super().__init__: every attribute is the wrapped optimizer's.
        self.optimizer = optimizer
        self.scaler = scaler
        self.device_placement = device_placement
        self.step_fn = step_fn
        self.gradient_state = GradientState()
        self._is_overflow = False  # Accelerate's name, which code and tests set and read
        self._unscaled = False

    # -- the wrapped optimizer's surface ------------------------------------------------------
    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch.optim casts the loaded state onto each parameter's device and dtype itself.
        self.optimizer.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not found normally: forward to the wrapped optimizer.
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    # -- stepping ----------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients, except on accumulation steps (they must keep adding up)."""
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def unscale_(self) -> None:
        """Divide the gradients by the loss scale (once per step; a no-op without a scaler)."""
        if self.scaler is not None and not self._unscaled and self.gradient_state.sync_gradients:
            self.scaler.unscale_(self.optimizer)
            self._unscaled = True

    def step(self, closure: Any = None) -> Any:
        """Step (on synchronisation steps only), through the scaler under fp16."""
        if not self.gradient_state.sync_gradients:
            return None
        result = None
        if self.scaler is not None:
            scale_before = self.scaler.get_scale()
            result = self.scaler.step(self.optimizer, *(() if closure is None else (closure,)))
            self.scaler.update()
            # GradScaler lowers the scale exactly when it found inf/nan and skipped the step.
            self._is_overflow = self.scaler.get_scale() < scale_before
        elif self.step_fn is not None:
            result = self.step_fn(self.optimizer, closure)
            self._is_overflow = False
        else:
            result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
            self._is_overflow = False
        self._unscaled = False
        return result

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``step()`` was skipped because of inf/nan gradients (fp16)."""
        return self._is_overflow

    def train(self) -> None:
        """Forward ``train()`` to optimizers that have modes (schedule-free optimizers)."""
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        """Forward ``eval()`` to optimizers that have modes (schedule-free optimizers)."""
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("gradient_state", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.gradient_state = GradientState()
