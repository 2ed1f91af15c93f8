"""``AcceleratedScheduler``: a learning-rate scheduler stepped in step with its optimizer(s).

A schedule is usually written for one process reading the whole dataset. On N processes (without
``split_batches``) each optimizer step consumes N batches, so the scheduler advances N steps per
call and the schedule still ends at the end of the data. It holds still when the optimizer step
was skipped (fp16 overflow), and on accumulation steps it only counts (``adjust_scheduler``).
"""

from __future__ import annotations

from typing import Any

from nbaccel.distributed.state import AcceleratorState, GradientState

__all__ = ["AcceleratedScheduler"]


class AcceleratedScheduler:
    """Wrap ``scheduler`` so that ``step()`` follows the optimizer(s).

    Args:
        scheduler: a torch LR scheduler.
        optimizers: the prepared optimizer(s) it follows.
        step_with_optimizer: False when the user steps the scheduler on their own schedule
            (e.g. once per epoch): then ``step()`` is passed straight through.
        split_batches: batches were split, not multiplied, across processes: one step per call.
    """

    def __init__(
        self,
        scheduler: Any,
        optimizers: Any,
        step_with_optimizer: bool = True,
        split_batches: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers if isinstance(optimizers, list | tuple) else [optimizers]
        self.split_batches = split_batches
        self.step_with_optimizer = step_with_optimizer
        self.gradient_state = GradientState()
        self.num_processes = AcceleratorState().num_processes

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advance the schedule as the optimizer(s) advanced."""
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            if self.gradient_state.adjust_scheduler:
                self.scheduler._step_count += 1
            return
        if any(getattr(opt, "step_was_skipped", False) for opt in self.optimizers):
            return
        if self.split_batches:
            self.scheduler.step(*args, **kwargs)
            return
        # OneCycleLR raises past its total_steps: stop once its step count (which counts the
        # construction's step, like Accelerate) passes it.
        total = getattr(self.scheduler, "total_steps", None)
        for _ in range(self.num_processes):
            if total is not None and self.scheduler._step_count > total:
                break
            self.scheduler.step(*args, **kwargs)

    # -- the wrapped scheduler's surface ------------------------------------------------------
    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_lr(self) -> Any:
        return self.scheduler.get_lr()

    def print_lr(self, *args: Any, **kwargs: Any) -> Any:
        return self.scheduler.print_lr(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"AcceleratedScheduler({self.scheduler!r})"
